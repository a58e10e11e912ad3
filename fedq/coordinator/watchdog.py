"""The watchdog: repairs what a chord cannot. Celery beat runs it on the control queue
every ``FEDQ_WATCHDOG_INTERVAL`` seconds (never a countdown task per round: ETA tasks
longer than Redis' visibility timeout are redelivered again and again).

For each running job it looks at the round after the last committed one and asks
:func:`fedq.coordinator.policy.repair` what to do:

- ``start``: no row for a grace period (the control worker died between a commit and
  the next ``start_round``, or the message was lost): request the round;
- ``deadline``: training past its deadline: finalize it (commit with the quorum,
  re-dispatch the missing clients, or fail the job);
- ``check``: training for longer than one interval: finalize, which commits if
  every client reported (a chord body lost with a killed control worker) and otherwise
  waits; while it waits, clients whose worker is lost (its task's heartbeat stopped for
  ``FEDQ_WORKER_LOST_S``: fedq/coordinator/liveness.py) are re-dispatched at once.

A buffered job (fedq/coordinator/buffered.py) has its own repairs:
:func:`fedq.coordinator.buffered.repair` (a lost worker's task is re-sent there too).
So has an inference job (:func:`fedq.inference.jobs.repair`); a shard whose worker is
lost is sent again here first (:func:`_rescue_shards`).

Every repair is idempotent (unique round rows, conditional UPDATEs), so two watchdogs
running at once, or a watchdog racing a chord, do no harm.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from fedq.coordinator import buffered, liveness
from fedq.coordinator.enrol import registry_if_required
from fedq.coordinator.finalize import finalize_round
from fedq.coordinator.intake import task_id
from fedq.coordinator.policy import lost_clients, repair
from fedq.coordinator.roster import mark_lost
from fedq.coordinator.rounds import redispatch, request_round
from fedq.db import Job, Round, WatchdogAction, session_scope
from fedq.db.models import aware, utcnow
from fedq.db.session import ensure_schema
from fedq.protocol.envelope import FEDQ_VERSION
from fedq.redaction import redact_text
from fedq.settings import Settings
from fedq.spec import JobSpec
from fedq.status import JobStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NextRound:
    """A running job and the round after its last committed one (None: no row yet)."""

    job: str
    number: int
    job_updated: datetime
    status: str | None
    started: datetime | None
    deadline: datetime | None
    buffered: bool = False


def scan(settings: Settings) -> list[NextRound | tuple[str, str]]:
    """Each running job's next round, or (job, why) for a job that cannot be read. Each
    job is read inside a savepoint of its own: on PostgreSQL one failed statement
    would otherwise abort the transaction, and with it every job after it."""
    with session_scope(settings.database_url) as s:
        out: list[NextRound | tuple[str, str]] = []
        for job_id in list(s.scalars(select(Job.id).where(Job.status == JobStatus.RUNNING))):
            try:
                with s.begin_nested():
                    out.append(_next_round(s, job_id))
            except ValidationError as exc:  # never readable by this coordinator: fail it
                out.append((job_id, _unreadable(s, job_id, exc)))
            except Exception as exc:  # noqa: BLE001 - one job's problem, not the pass's
                out.append((job_id, _why(exc)))
        return out


def _unreadable(s: Session, job_id: str, exc: ValidationError) -> str:
    """Fail a running job whose stored spec this coordinator's schema refuses (a spec
    written by a newer ``fedq submit``, say), once, with what to do: otherwise the
    watchdog would find it unreadable every pass, forever."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
    where = ".".join(str(part) for part in first.get("loc", ())) or "spec"
    reason = redact_text(
        f"this coordinator (fedq {FEDQ_VERSION}) cannot read the job's spec: {where}: "
        f"{first.get('msg', '')} (a spec from a newer fedq submit? upgrade the control "
        f"worker, then `fedq resume {job_id}`)")[:1000]
    job = s.get(Job, job_id)
    if job is not None and job.status == JobStatus.RUNNING:
        job.status, job.error, job.finished_at = JobStatus.FAILED, reason, utcnow()
    return reason


def _next_round(s: Session, job_id: str) -> NextRound:
    job = s.get(Job, job_id)
    assert job is not None
    number = job.committed_round + 1
    rnd = s.scalar(select(Round).where(Round.job_id == job.id, Round.number == number))
    return NextRound(job.id, number, aware(job.updated_at), rnd.status if rnd else None,
                     aware(rnd.started_at) if rnd else None,
                     aware(rnd.deadline) if rnd and rnd.deadline else None,
                     JobSpec.stored(job.spec).buffered)


def _why(exc: BaseException) -> str:
    return redact_text(f"{type(exc).__name__}: {exc}".splitlines()[0])[:500]


def _outcome(result: Any) -> str | None:
    if isinstance(result, dict):
        result = result.get("status")
    return None if result is None else str(result)[:32]


def _repair(settings: Settings, item: NextRound, now: datetime,
            grace: timedelta) -> list[dict[str, Any]]:
    """What the watchdog does for one running job."""
    if item.buffered:
        return buffered.repair(settings, item.job, grace)
    what = repair(item.job_updated, item.status, item.started, item.deadline, now, grace,
                  check_after=timedelta(seconds=settings.watchdog_interval))
    if what == "start":
        request_round(item.job, item.number)
        return [{"job": item.job, "round": item.number, "action": "start"}]
    if what is None:
        return []
    result = finalize_round(settings, item.job, item.number)
    if what == "check" and result.get("status") == "waiting":
        return _rescue(settings, item, result)  # clients still training, or lost
    why = "deadline" if what == "deadline" else "stuck"
    return [{"job": item.job, "round": item.number, "action": f"finalize ({why})",
             "result": result.get("status")}]


def _rescue(settings: Settings, item: NextRound, waiting: dict[str, Any]
            ) -> list[dict[str, Any]]:
    """Re-dispatch the clients of a waiting round whose worker is lost, or stepped
    aside for its owner (``yielded``: sent again now, not at the deadline)."""
    attempt, gen, pending = waiting["attempt"], waiting["gen"], waiting["pending"]
    yielded = list(waiting.get("yielded") or [])
    tasks = {task_id(item.job, item.number, a, c, gen): c
             for c in pending for a in range(1, attempt + 1)}
    holders = liveness.observe(settings, item.job, tasks)
    lost = lost_clients([(h.client, h.silent_s, h.resent) for h in holders], pending,
                        settings.worker_lost_s)
    again = sorted({*lost, *yielded})
    if lost:
        _close_lost_sites(settings, item.job, [(h.host, h.client) for h in holders
                                               if h.client in lost])
    if not again or not waiting["can_redispatch"]:
        return []  # nothing lost, or out of attempts: the deadline decides
    hosts = sorted({h.host for h in holders if h.client in lost})
    if not redispatch(settings, item.job, item.number, attempt, again,
                      for_yields=not lost):
        return []
    liveness.mark_resent(settings, [h.task_id for h in holders if h.client in lost])
    why = ", ".join(x for x in (f"lost {', '.join(hosts)}" if lost else "",
                                "yielded" if yielded else "") if x)
    return [{"job": item.job, "round": item.number,
             "action": f"redispatch ({why})"[:64],
             "result": f"clients {again}, attempt {attempt + 1}"}]


def _rescue_shards(settings: Settings) -> list[dict[str, Any]]:
    """Send again, now, the inference shards whose worker is lost: every copy of the
    shard has a claim whose heartbeat has not moved for ``FEDQ_WORKER_LOST_S``. It
    counts as one failure of the shard (``max_redispatch``), as its timeout would."""
    from fedq.inference import jobs as inference

    actions: list[dict[str, Any]] = []
    for job_id, tasks, latest in inference.running_tasks(settings):
        try:
            holders = liveness.observe(settings, job_id, tasks)
            lost = lost_clients([(h.client, h.silent_s, h.resent) for h in holders], latest,
                                settings.worker_lost_s)
            for shard in lost:
                mine = [h for h in holders if h.client == shard]
                hosts = ", ".join(sorted({h.host for h in mine}))
                out = inference.settle(settings, job_id, shard, latest[shard],
                                       inference.Verdict("error", f"heartbeat lost ({hosts}) "
                                                         f"for {settings.worker_lost_s:g} s"))
                liveness.mark_resent(settings, [h.task_id for h in mine])
                actions.append({"job": job_id, "shard": shard,
                                "action": f"resend (lost {hosts})", "result": out["status"]})
        except Exception as exc:  # noqa: BLE001 - one job's error never stops the others
            log.exception("fedq watchdog: rescuing inference job %s's shards failed", job_id)
            actions.append({"job": job_id, "action": "error (repair)", "result": "error",
                            "error": _why(exc)})
    return actions


def _close_lost_sites(settings: Settings, job_id: str, lost: list[tuple[str, int]]) -> None:
    """With ``sites``: the lost hosts' sites are closed, so the next rounds take their
    clients last (roster.mark_lost; this round keeps its clients and re-sends them)."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        spec = JobSpec.stored(job.spec) if job is not None else None
        if spec is not None and spec.sites is not None:
            mark_lost(s, [(host, spec.site_queue_of(client) or "") for host, client in lost])


#: The PostgreSQL advisory lock a watchdog pass holds (any number; fedq's own).
PASS_LOCK = 0x66656471  # "fedq"


@contextmanager
def single_pass(settings: Settings) -> Iterator[bool]:
    """Whether this process may run a watchdog pass now: True while it holds the
    database-wide pass lock (PostgreSQL: a session advisory lock, released with its
    connection if the process dies; SQLite: a lock file beside the database), False
    when another pass holds it. Two passes at once (beat's tick landing on two control
    processes, or a restarted control worker beside the old one) would each see the
    same lost client and send it twice, spending two of its re-dispatches on one
    loss."""
    url = settings.database_url
    if url.startswith("postgresql"):
        from sqlalchemy import text

        from fedq.db.session import connect

        with connect(url).connect() as conn:
            got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"),
                                    {"k": PASS_LOCK}).scalar())
            conn.commit()
            try:
                yield got
            finally:
                if got:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": PASS_LOCK})
                    conn.commit()
        return
    import fcntl

    path = settings.home / "watchdog.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_watchdog(settings: Settings) -> list[dict[str, Any]]:
    """One pass over the running jobs; returns what it did, one dict per action. A
    pass that finds another running (:func:`single_pass`) does nothing."""
    ensure_schema(settings.database_url)
    with single_pass(settings) as mine:
        if not mine:
            log.info("fedq watchdog: another pass is running; this one does nothing")
            return []
        return _pass(settings)


def _restore_users(settings: Settings) -> list[dict[str, Any]]:
    """The registered workers' Redis users made again where Redis lost them (a restart
    without its ACL): joined workers reconnect with their own users."""
    from fedq.coordinator.enrol import restore_users

    try:
        restored = restore_users(settings)
    except Exception as exc:  # noqa: BLE001 - never stops the repairs
        log.warning("fedq watchdog: could not check the workers' Redis users: %s", _why(exc))
        return []
    return [{"job": "workers", "action": "restore broker users",
             "result": ",".join(restored)[:32]}] if restored else []


def _pass(settings: Settings) -> list[dict[str, Any]]:
    grace = timedelta(seconds=max(2 * settings.watchdog_interval, 5.0))
    now = utcnow()
    actions: list[dict[str, Any]] = _restore_users(settings)
    liveness.forget_stopped(settings)
    for item in scan(settings):
        if isinstance(item, tuple):
            job, why = item
            log.error("fedq watchdog: job %s cannot be read: %s", job, why)
            actions.append({"job": job, "action": "error (read)", "result": "error",
                            "error": why})
            continue
        try:
            actions += _repair(settings, item, now, grace)
        except Exception as exc:  # noqa: BLE001 - one job's error never stops the others
            log.exception("fedq watchdog: repairing job %s failed", item.job)
            actions.append({"job": item.job, "round": item.number, "action": "error (repair)",
                            "result": "error", "error": _why(exc)})
    try:  # batch inference jobs (fedq/inference/jobs.py)
        from fedq.inference.jobs import repair as repair_inference

        actions += _rescue_shards(settings)
        actions += repair_inference(settings, registry_if_required(settings))
    except Exception as exc:  # noqa: BLE001 - never stops the training repairs
        log.exception("fedq watchdog: repairing inference jobs failed")
        actions.append({"job": "inference", "action": "error (repair)", "result": "error",
                        "error": _why(exc)})
    for action in actions:
        log.warning("fedq watchdog: %s", action)
    if actions:
        with session_scope(settings.database_url) as s:
            s.add_all(WatchdogAction(job_id=str(a["job"]),
                                     round_number=a.get("round", a.get("version")),
                                     action=str(a["action"])[:64],
                                     result=_outcome(a.get("result")),
                                     error=a.get("error")) for a in actions)
    return actions
