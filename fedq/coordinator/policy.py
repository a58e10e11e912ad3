"""The round's decisions as pure functions: no database, broker or clock of their own.

:func:`pick_results` chooses one result per planned client from whatever arrived
(chord results, results read back from the backend, duplicates, results of other
rounds); :func:`decide` turns (round state, chosen results, now) into one of
:class:`Wait`, :class:`Commit`, :class:`Redispatch`, :class:`Fail`;
:func:`repair` is the watchdog's choice for a running job. ``finalize_round`` and the
watchdog call them and do the I/O; tests/test_policy.py drives every branch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Literal

from fedq.protocol.training import UpdateRef
from fedq.status import FAILED_UPDATES, RoundStatus, UpdateStatus, failed_status


@dataclass(frozen=True)
class RoundState:
    """What the decision needs to know of an open round."""

    job: str
    number: int
    gen: int  # the round row's id: tells a resumed round from the one it replaced
    attempt: int  # dispatch attempt now in flight (1 = the first)
    clients: tuple[int, ...]
    deadline: datetime | None
    quorum: int  # usable updates a commit needs
    max_redispatch: int  # re-dispatches allowed before the job fails
    # client -> the last attempt it was sent as (None: a round from before this was
    # kept, when every client counted as sent with ``attempt``)
    sent: Mapping[int, int] | None = None
    yields: int = 0  # re-dispatches made only for workers that stepped aside: not counted

    @property
    def can_redispatch(self) -> bool:
        """Whether another re-dispatch is allowed (one for a yield does not count)."""
        return self.attempt - self.yields <= self.max_redispatch

    def sent_as(self, client: int) -> int:
        return self.attempt if self.sent is None else self.sent.get(client, 1)


@dataclass(frozen=True)
class Wait:
    """Some clients still owe a result and the deadline has not passed."""

    pending: tuple[int, ...]


@dataclass(frozen=True)
class Commit:
    """Aggregate ``usable``; record ``missing`` (no result at all) as missing."""

    usable: tuple[int, ...]
    missing: tuple[int, ...]


@dataclass(frozen=True)
class Redispatch:
    """Send ``clients`` again as dispatch attempt ``attempt``."""

    clients: tuple[int, ...]
    attempt: int


@dataclass(frozen=True)
class Fail:
    """Too few usable updates after every allowed attempt: fail the job."""

    clients: tuple[int, ...]  # those without a usable update
    usable: int


Decision = Wait | Commit | Redispatch | Fail


def pick_results(results: Iterable[UpdateRef], state: RoundState) -> dict[int, UpdateRef]:
    """One result per planned client of this round: an ok one if any (earliest attempt
    first), else the failure (error or rejection) of the latest attempt. The results
    were attributed by their task ids (fedq/coordinator/intake.py); those of other
    jobs, rounds or generations (a resumed round), and of unplanned clients, are
    ignored."""
    chosen: dict[int, UpdateRef] = {}
    wanted = set(state.clients)
    for ref in results:
        if (ref.job, ref.round, ref.gen) != (state.job, state.number, state.gen) or \
                ref.client not in wanted:
            continue
        have = chosen.get(ref.client)
        if have is None or _better(ref, have):
            chosen[ref.client] = ref
    return dict(sorted(chosen.items()))


def counted_as(ref: UpdateRef) -> str:
    """Whom an update counts against for ``max_updates_per_worker``: the registered
    worker that signed it (FEDQ_IDENTITY=required), else the name the result gives."""
    return ref.signer or ref.worker


def cap_per_worker(chosen: dict[int, UpdateRef], cap: int | None) -> dict[int, UpdateRef]:
    """``chosen`` (client -> result, from :func:`pick_results`) with at most ``cap`` ok
    results counted per worker (:func:`counted_as`): a worker's lowest-numbered clients
    count, the rest are rejected, saying so (their clients may be sent again). So one
    machine supplies at most ``cap`` of a round's updates, however many of its tasks
    its processes took: a robust reducer's ``f`` is ``cap`` per distrusted machine."""
    if cap is None:
        return chosen
    out: dict[int, UpdateRef] = {}
    seen: dict[str, int] = {}
    for client, ref in sorted(chosen.items()):
        if ref.status == UpdateStatus.OK:
            who = counted_as(ref)
            seen[who] = seen.get(who, 0) + 1
            if seen[who] > cap:
                ref = replace(ref, status=UpdateStatus.REJECTED, error=over_cap(who, cap))
        out[client] = ref
    return out


CAP_PREFIX = "cap: "


def over_cap(who: str, cap: int) -> str:
    return (f"{CAP_PREFIX}worker {who[:64]} already counts {cap} update(s) here "
            f"(max_updates_per_worker {cap})")


def _better(new: UpdateRef, have: UpdateRef) -> bool:
    if have.status != UpdateStatus.OK:
        return new.status == UpdateStatus.OK or new.attempt > have.attempt
    return new.status == UpdateStatus.OK and new.attempt < have.attempt


def unsettled(chosen: dict[int, UpdateRef], state: RoundState) -> tuple[int, ...]:
    """Clients still owed a result: none yet, or only a failure of an earlier attempt
    than the one it was last sent as (the re-dispatched task has not reported)."""
    return tuple(c for c in state.clients
                 if c not in chosen or (chosen[c].status != "ok"
                                        and chosen[c].attempt < state.sent_as(c)))


def yielded_clients(chosen: dict[int, UpdateRef], state: RoundState) -> tuple[int, ...]:
    """Clients whose worker stepped aside for its owner on the attempt they were last
    sent as: to be sent again now (fedq/worker/owner.py), not at the deadline."""
    return tuple(c for c, ref in chosen.items()
                 if ref.status == UpdateStatus.YIELDED and ref.attempt == state.sent_as(c))


def decide(state: RoundState, chosen: dict[int, UpdateRef], now: datetime,
           rejected: Sequence[int] = ()) -> Decision:
    """What to do with the round now. ``rejected``: clients whose ok result failed
    verification (known only after their blobs were read: call again with them)."""
    pending = unsettled(chosen, state)
    if pending and (state.deadline is None or now < state.deadline):
        return Wait(pending)
    usable = tuple(c for c in state.clients
                   if c in chosen and chosen[c].status == "ok" and c not in rejected)
    if len(usable) >= state.quorum:
        return Commit(usable, tuple(c for c in state.clients if c not in chosen))
    retry = tuple(c for c in state.clients if c not in usable)
    if state.can_redispatch:
        return Redispatch(retry, state.attempt + 1)
    return Fail(retry, len(usable))


Repair = Literal["start", "deadline", "check"]


def repair(job_updated: datetime, round_status: str | None, started: datetime | None,
           deadline: datetime | None, now: datetime, grace: timedelta,
           check_after: timedelta) -> Repair | None:
    """The watchdog's choice for a running job's next round:

    - ``start``: no round row for a grace period (a lost ``start_round``);
    - ``deadline``: the round is training past its deadline: finalize it;
    - ``check``: training for longer than ``check_after`` (one watchdog interval):
      finalize if every client reported (a chord body lost with a killed control
      worker), else it waits, and clients whose worker is lost are sent again;
    - None: nothing to do.
    """
    if round_status is None:
        return "start" if now - job_updated > grace else None
    if round_status != RoundStatus.TRAINING:
        return None
    if deadline is not None and now >= deadline:
        return "deadline"
    if started is not None and now - started > check_after:
        return "check"
    return None


def lost_clients(claims: Iterable[tuple[int, float, bool]], pending: Iterable[int],
                 lost_s: float) -> tuple[int, ...]:
    """Clients to send again now because their worker is lost. ``claims``: (client,
    seconds since its heartbeat last moved, already sent again) of each started task
    (fedq/coordinator/liveness.py). A pending client is lost when it has a claim silent
    for ``lost_s`` that was not yet acted on, and no claim that still beats (an earlier
    attempt that came back alive still counts)."""
    silent: set[int] = set()
    beating: set[int] = set()
    for client, silent_s, resent in claims:
        if silent_s < lost_s:
            beating.add(client)
        elif not resent:
            silent.add(client)
    return tuple(c for c in sorted(set(pending)) if c in silent and c not in beating)


# -- buffered jobs (fedq/coordinator/buffered.py does the I/O around these) ----------

#: A finished task's row in a buffered job: (status, error, queue).
TaskRow = tuple[str, str | None, str | None]


def absorb_status(ref_status: str, has_blob: bool, job_running: bool, version: int,
                  rounds: int, staleness: int, max_staleness: int | None
                  ) -> tuple[str, str | None]:
    """(status, error) for a buffered task's result as it is absorbed: ``late`` after
    the job stopped, the failure as reported (``error``, or ``rejected`` by intake),
    ``late`` when every version is full, ``stale`` past ``max_staleness``, else
    ``buffered`` into ``version``. The error of a failure is the caller's (the
    worker's or intake's words)."""
    if not job_running:
        return UpdateStatus.LATE, "arrived after the job stopped"
    if ref_status != "ok" or not has_blob:
        return failed_status(ref_status), None
    if version > rounds:
        return UpdateStatus.LATE, "every version is full"
    if max_staleness is not None and staleness > max_staleness:
        return UpdateStatus.STALE, f"staleness {staleness} > {max_staleness}"
    return UpdateStatus.BUFFERED, None


def failing(last: Sequence[TaskRow], window: int, job_id: str) -> str | None:
    """A reason to fail a buffered job when its last ``window`` settled tasks (newest
    first; window = clients_per_round x (max_redispatch + 1)) all failed or had their
    update rejected, else None."""
    if len(last) < window or any(status not in FAILED_UPDATES
                                 for status, _, _ in last[:window]):
        return None
    errors = sorted({error or "task failed" for _, error, _ in last[:window]})
    queues = sorted({queue or "?" for _, _, queue in last[:window]})
    return (f"the last {window} training tasks all failed (clients_per_round x "
            f"(max_redispatch + 1); a rejected update counts as failed) on queue(s) "
            f"{', '.join(queues)}: "
            f"{'; '.join(errors)[:1000]}. Fix that, then `fedq resume {job_id}`.")


OverdueAction = Literal["resend", "replace"]


def overdue(attempt: int, max_redispatch: int) -> OverdueAction:
    """A buffered task past its deadline with no result: send it again as the next
    attempt, or after ``max_redispatch`` re-sends give its slot to another client."""
    return "resend" if attempt <= max_redispatch else "replace"
