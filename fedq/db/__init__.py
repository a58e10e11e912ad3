"""The database: the source of truth for jobs, rounds, client updates and workers."""

from fedq.db.models import Base, Claim, ClientUpdate, Job, Round, WatchdogAction, Worker
from fedq.db.session import connect, session_scope, upgrade

__all__ = ["Base", "Claim", "ClientUpdate", "Job", "Round", "WatchdogAction", "Worker", "connect",
           "session_scope", "upgrade"]
