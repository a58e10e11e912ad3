"""The round's decisions (fedq/coordinator/policy.py), table-driven: every branch of
pick_results, decide, the watchdog's repair and its lost-worker choice, and a buffered
job's absorb status, failing window and overdue choice, with no services."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from fedq.coordinator.policy import (
    Commit,
    Fail,
    Redispatch,
    RoundState,
    Wait,
    absorb_status,
    cap_per_worker,
    decide,
    failing,
    lost_clients,
    overdue,
    pick_results,
    repair,
)
from fedq.protocol.training import UpdateRef

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
DEADLINE = T0 + timedelta(seconds=60)
BEFORE, AFTER = T0 + timedelta(seconds=10), T0 + timedelta(seconds=61)


def state(attempt: int = 1, quorum: int = 2, max_redispatch: int = 1) -> RoundState:
    return RoundState(job="j", number=3, gen=7, attempt=attempt, clients=(0, 1, 2),
                      deadline=DEADLINE, quorum=quorum, max_redispatch=max_redispatch)


def ref(client: int, status: str = "ok", attempt: int = 1, **kw: Any) -> UpdateRef:
    """A result as intake admitted it (fedq/coordinator/intake.py)."""
    fields: dict[str, Any] = {
        "status": status, "job": "j", "round": 3, "client": client, "queue": "cpu",
        "worker": "w", "attempt": attempt, "gen": 7, "key": f"k{client}-{attempt}",
        "sha256": "0" * 64, "samples": 10, **kw}
    return UpdateRef(**fields)


@pytest.mark.parametrize(("results", "expected"), [
    # no result
    ([], {}),
    # an ok result
    ([ref(0)], {0: ("ok", 1)}),
    # duplicate delivery of the same result: one
    ([ref(0), ref(0)], {0: ("ok", 1)}),
    # ok beats an error, whatever the order
    ([ref(0, "error"), ref(0, attempt=2)], {0: ("ok", 2)}),
    ([ref(0, attempt=2), ref(0, "error")], {0: ("ok", 2)}),
    # two ok results (a re-dispatched task and the original): the earliest attempt
    ([ref(0, attempt=2), ref(0, attempt=1)], {0: ("ok", 1)}),
    # two errors: the latest attempt's
    ([ref(0, "error", attempt=1), ref(0, "error", attempt=2)], {0: ("error", 2)}),
    # another round, another generation (a resumed round), another job, unplanned client
    ([ref(0, round=2), ref(1, gen=6), ref(2, job="x"), ref(9)], {}),
    # a rejected result (intake refused it) counts as a failure; an ok one beats it
    ([ref(0, "rejected")], {0: ("rejected", 1)}),
    ([ref(0, "rejected"), ref(0, attempt=2)], {0: ("ok", 2)}),
])
def test_pick_results(results: list[Any], expected: dict[int, tuple[str, int]]) -> None:
    chosen = pick_results(results, state())
    assert {c: (r.status, r.attempt) for c, r in chosen.items()} == expected


@pytest.mark.parametrize(("st", "results", "now", "rejected", "expected"), [
    # all reported before the deadline: commit
    (state(), [ref(0), ref(1), ref(2)], BEFORE, (), Commit((0, 1, 2), ())),
    # one missing before the deadline: wait for it
    (state(), [ref(0), ref(1)], BEFORE, (), Wait((2,))),
    # one missing at the deadline, quorum met: commit, record it missing
    (state(), [ref(0), ref(1)], AFTER, (), Commit((0, 1), (2,))),
    # an error counts as reported: commit the two ok ones without waiting
    (state(), [ref(0), ref(1), ref(2, "error")], BEFORE, (), Commit((0, 1), ())),
    # an error of an earlier attempt while attempt 2 runs: wait for the re-dispatched task
    (state(attempt=2), [ref(0), ref(1), ref(2, "error")], BEFORE, (), Wait((2,))),
    # ... and at the deadline: commit with what is there
    (state(attempt=2), [ref(0), ref(1), ref(2, "error")], AFTER, (), Commit((0, 1), ())),
    # below quorum at the deadline, re-dispatch allowed: send the two without an update
    (state(), [ref(0)], AFTER, (), Redispatch((1, 2), 2)),
    # below quorum after the last allowed attempt: fail
    (state(attempt=2), [ref(0)], AFTER, (), Fail((1, 2), 1)),
    (state(max_redispatch=0), [ref(0)], AFTER, (), Fail((1, 2), 1)),
    # all errors before the deadline: nothing pending, below quorum: re-dispatch now
    (state(), [ref(0, "error"), ref(1, "error"), ref(2, "error")], BEFORE, (),
     Redispatch((0, 1, 2), 2)),
    # verification rejected one of three: still the quorum of two
    (state(), [ref(0), ref(1), ref(2)], BEFORE, (2,), Commit((0, 1), ())),
    # ... rejected two: below quorum, re-dispatch them
    (state(), [ref(0), ref(1), ref(2)], BEFORE, (1, 2), Redispatch((1, 2), 2)),
    # no deadline set: wait as long as it takes
    (RoundState("j", 3, 7, 1, (0, 1), None, 1, 0), [ref(0)], AFTER, (), Wait((1,))),
])
def test_decide(st: RoundState, results: list[Any], now: datetime, rejected: tuple[int, ...],
                expected: object) -> None:
    assert decide(st, pick_results(results, st), now, rejected) == expected


GRACE = timedelta(seconds=10)


@pytest.mark.parametrize(("job_updated", "status", "started", "deadline", "expected"), [
    # committed a while ago and no next round: the start was lost
    (T0, None, None, None, "start"),
    # committed just now: its start_round is on its way
    (AFTER - timedelta(seconds=5), None, None, None, None),
    # training, past its deadline
    (T0, "training", T0, DEADLINE, "deadline"),
    # training, younger than one interval
    (T0, "training", AFTER - timedelta(seconds=1), DEADLINE + timedelta(hours=1), None),
    # training longer than one watchdog interval, before its deadline: check for a lost
    # chord and lost workers
    (T0, "training", T0, DEADLINE + timedelta(hours=1), "check"),
    (T0, "training", AFTER - timedelta(seconds=3), DEADLINE + timedelta(hours=1), "check"),
    # finished rounds need nothing
    (T0, "committed", T0, DEADLINE, None),
    (T0, "failed", T0, DEADLINE, None),
])
def test_watchdog_repair(job_updated: datetime, status: str | None, started: datetime | None,
                         deadline: datetime | None, expected: str | None) -> None:
    assert repair(job_updated, status, started, deadline, AFTER, GRACE,
                  check_after=timedelta(seconds=2)) == expected


# -- buffered jobs: the pure decisions fedq/coordinator/buffered.py acts on ----------


@pytest.mark.parametrize(("args", "expected"), [
    # (ref status, has blob, job running, version, rounds, staleness, max_staleness)
    (("ok", True, True, 2, 5, 1, None), ("buffered", None)),
    (("ok", True, False, 2, 5, 1, None), ("late", "arrived after the job stopped")),
    (("error", False, True, 2, 5, 1, None), ("error", None)),
    (("rejected", False, True, 2, 5, 1, None), ("rejected", None)),
    (("ok", False, True, 2, 5, 1, None), ("error", None)),  # ok without a blob
    (("ok", True, True, 6, 5, 0, None), ("late", "every version is full")),
    (("ok", True, True, 3, 5, 3, 2), ("stale", "staleness 3 > 2")),
    (("ok", True, True, 3, 5, 2, 2), ("buffered", None)),  # at the bound: kept
    # a failure after the job stopped is late, not a failure that could fail the job
    (("error", False, False, 0, 5, 0, None), ("late", "arrived after the job stopped")),
])
def test_absorb_status(args: tuple, expected: tuple) -> None:
    assert absorb_status(*args) == expected


def test_failing_needs_a_whole_window_of_failures() -> None:
    bad = ("error", "boom", "cpu")
    assert failing([bad] * 3, 4, "j") is None  # not a window yet
    assert failing([bad, bad, ("ok", None, "cpu"), bad], 4, "j") is None
    why = failing([bad, ("rejected", "weight: too many", "gpu_new"), bad, bad], 4, "j")
    assert why is not None and why.startswith("the last 4 training tasks all failed")
    assert "boom; weight: too many" in why and "cpu, gpu_new" in why
    assert why.endswith("`fedq resume j`.")


@pytest.mark.parametrize(("attempt", "max_redispatch", "expected"), [
    (1, 2, "resend"), (2, 2, "resend"), (3, 2, "replace"), (1, 0, "replace")])
def test_overdue(attempt: int, max_redispatch: int, expected: str) -> None:
    assert overdue(attempt, max_redispatch) == expected


@pytest.mark.parametrize(("claims", "pending", "expected"), [
    ([], (0, 1), ()),  # nothing started yet: queued, the deadline decides
    ([(0, 3.0, False)], (0, 1), ()),  # beating
    ([(0, 15.0, False)], (0, 1), (0,)),  # silent for the bound: lost
    ([(0, 14.9, False)], (0,), ()),  # not yet
    ([(0, 40.0, True)], (0,), ()),  # already sent again for this claim
    ([(0, 40.0, True), (0, 20.0, False)], (0,), (0,)),  # and its second worker died too
    ([(0, 40.0, False), (0, 2.0, False)], (0,), ()),  # another attempt of it still beats
    ([(2, 30.0, False)], (0, 1), ()),  # not pending: it reported meanwhile
    ([(1, 30.0, False), (0, 30.0, False)], (0, 1, 2), (0, 1)),
])
def test_lost_clients(claims: list[tuple[int, float, bool]], pending: tuple[int, ...],
                      expected: tuple[int, ...]) -> None:
    assert lost_clients(claims, pending, 15.0) == expected


def test_one_worker_counts_at_most_its_cap_of_a_rounds_updates() -> None:
    """max_updates_per_worker: a machine whose processes took four of a round's tasks
    counts for two (its lowest clients); by signer when results are signed, so three
    process names under one registration are one machine; failures are not counted."""
    chosen = {0: ref(0, worker="p1@m", signer="m"), 1: ref(1, worker="h@h", signer="h"),
              2: ref(2, worker="p2@m", signer="m"), 3: ref(3, "error", worker="p3@m",
                                                          signer="m"),
              4: ref(4, worker="p3@m", signer="m"), 5: ref(5, worker="p1@m", signer="m")}
    capped = cap_per_worker(chosen, 2)
    assert [c for c, r in capped.items() if r.status == "ok"] == [0, 1, 2]
    assert capped[3].status == "error"  # untouched
    for client in (4, 5):
        assert capped[client].status == "rejected"
        assert capped[client].error == ("cap: worker m already counts 2 update(s) here "
                                        "(max_updates_per_worker 2)")
    assert cap_per_worker(chosen, None) == chosen
    # unsigned results count by the name each gives: three processes, three names
    unsigned = {c: ref(c, worker=f"p{c}@m") for c in range(3)}
    assert all(r.status == "ok" for r in cap_per_worker(unsigned, 1).values())
