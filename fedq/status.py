"""Every status a job, a round (a buffered job's model version), a client update or an
inference shard can be in. str-valued: the database columns and JSON hold these words, and a member
compares equal to its word (``JobStatus.RUNNING == "running"``).

How a row moves from one to the next is written where it moves: synchronous rounds in
fedq/coordinator/finalize.py, buffered versions and their tasks in
fedq/coordinator/buffered.py; docs/architecture.md draws both.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    RUNNING = "running"  # submitted or resumed: its rounds are being trained
    COMPLETED = "completed"  # its last round committed
    FAILED = "failed"  # a round could not reach its quorum, or every recent task failed
    CANCELLED = "cancelled"  # `fedq cancel`


class RoundStatus(StrEnum):
    TRAINING = "training"  # open: its tasks are out (buffered: its version is filling)
    COMMITTED = "committed"  # its model is the job's (exactly once)
    FAILED = "failed"  # closed without a model (quorum missed, or the job cancelled)


class UpdateStatus(StrEnum):
    OK = "ok"  # averaged into its round's model
    ERROR = "error"  # the task failed on the worker
    REJECTED = "rejected"  # intake or verification refused it (the reason is in error)
    MISSING = "missing"  # no result by the deadline, after every re-dispatch
    LATE = "late"  # arrived after its round committed (or its job stopped): not used
    CANCELLED = "cancelled"  # its job was cancelled, finished or resumed while it trained
    YIELDED = "yielded"  # its worker stepped aside for the machine's owner: sent elsewhere
    # buffered jobs only
    TRAINING = "training"  # dispatched, no result yet
    BUFFERED = "buffered"  # absorbed: waiting for its version to fill and be applied
    STALE = "stale"  # more than max_staleness versions old: not used


#: Job states a job ends in.
FINISHED = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)
#: Job states `fedq resume` starts again from.
RESUMABLE = (JobStatus.FAILED, JobStatus.CANCELLED)
#: Update states of a task that failed (a rejected update counts as failed).
FAILED_UPDATES = (UpdateStatus.ERROR, UpdateStatus.REJECTED)


def failed_status(reported: str) -> UpdateStatus:
    """The row status of a result without a usable update: a worker that stepped aside
    for its owner ``yielded`` (not a failure), one intake refused ``rejected``, else
    ``error``."""
    if reported == UpdateStatus.YIELDED:
        return UpdateStatus.YIELDED
    return UpdateStatus.REJECTED if reported == UpdateStatus.REJECTED else UpdateStatus.ERROR


class ShardStatus(StrEnum):
    """An inference job's shard (fedq/inference/jobs.py)."""

    QUEUED = "queued"  # waiting to be sent (or to be sent again)
    RUNNING = "running"  # sent: a copy is out
    DONE = "done"  # an answer checked out: its output counts
    FAILED = "failed"  # failed max_redispatch + 1 times: its job failed
    CANCELLED = "cancelled"  # its job was cancelled or failed first
