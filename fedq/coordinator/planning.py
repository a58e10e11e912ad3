"""Who trains, and on which queue: the plan of a round's tasks (synchronous rounds)
and the split of a job's tasks over the training queues (both modes). Pure functions
of the spec, the round and the live workers' measured throughput."""

from __future__ import annotations

from dataclasses import dataclass

from fedq.engine.names import TRAINING_QUEUES, site_queue
from fedq.spec import JobSpec


def queue_counts(spec: JobSpec, live_throughput: dict[str, float] | None = None,
                 size: int | None = None) -> dict[str, int]:
    """How many tasks go to each training queue per round (sums to ``size``, by default
    clients_per_round): the spec's ``queues``, or with ``queues: auto`` a split
    following ``live_throughput`` (queue -> summed samples/s of its live workers; with
    none known, every task goes to ``cpu``). A ``size`` other than clients_per_round
    (``clients_per_worker``) goes to the spec's one queue (JobSpec checks there is one)."""
    tasks = spec.clients_per_round if size is None else size
    if spec.queues == "auto":
        return split_by_throughput(tasks, live_throughput or {})
    counts = spec.fixed_queue_counts()
    if tasks == spec.clients_per_round:
        return counts
    (queue,) = counts
    return {queue: tasks}


def job_queues(spec: JobSpec) -> list[str]:
    """The training queues a job's tasks go to: its sites' (``sites``), else those its
    ``queues`` split names (``queues: auto`` with nothing known: ``cpu``)."""
    if spec.sites is not None:
        return sorted(site_queue(n) for n in spec.sites)
    return sorted(queue_counts(spec, {}))


def sized_queues(spec: JobSpec) -> list[str]:
    """The training queues whose workers size a round (``clients_per_worker``)."""
    return list(TRAINING_QUEUES) if spec.queues == "auto" else \
        [q for q, n in spec.queues.items() if n]


def split_by_throughput(tasks: int, throughput: dict[str, float]) -> dict[str, int]:
    """Largest-remainder split of ``tasks`` across training queues in proportion to their
    throughput; queues in TRAINING_QUEUES order break ties. Pure, for tests."""
    usable = {q: throughput[q] for q in TRAINING_QUEUES if throughput.get(q, 0) > 0}
    if not usable:
        return {"cpu": tasks}
    total = sum(usable.values())
    exact = {q: tasks * v / total for q, v in usable.items()}
    counts = {q: int(e) for q, e in exact.items()}
    by_remainder = sorted(usable, key=lambda q: (-(exact[q] - counts[q]),
                                                 TRAINING_QUEUES.index(q)))
    for q in by_remainder[:tasks - sum(counts.values())]:
        counts[q] += 1
    return {q: n for q, n in counts.items() if n > 0}


@dataclass(frozen=True)
class Assignment:
    client: int
    queue: str


def plan_round(spec: JobSpec, round_number: int,
               live_throughput: dict[str, float] | None = None,
               available: int | None = None,
               open_sites: frozenset[str] | None = None) -> list[Assignment]:
    """Which clients train in ``round_number`` and on which queue; a pure function of
    (spec, round, live throughput, workers available, sites open), so a re-planned
    round picks the same clients. ``available`` sizes the round when the spec sets
    ``clients_per_worker`` (JobSpec.round_size). With ``sites``, each client trains on
    its site's queue, and the round takes the clients of ``open_sites`` (sites with a
    worker that can train now) first, in a seeded order, then others'."""
    import numpy as np  # here: the CLI imports this module to read jobs, and needs none

    size = spec.round_size(available)
    rng = np.random.default_rng([spec.seed, round_number])
    if spec.sites is not None:
        order = [int(c) for c in rng.permutation(spec.num_clients)]
        opened = open_clients(spec, open_sites)
        chosen = sorted(order, key=lambda c: opened is not None and c not in opened)[:size]
        return [Assignment(c, spec.site_queue_of(c) or "") for c in sorted(chosen)]
    clients = sorted(int(c) for c in rng.choice(spec.num_clients, size, replace=False))
    queues = [q for q, n in queue_counts(spec, live_throughput, size).items()
              for _ in range(n)]
    return [Assignment(c, q) for c, q in zip(clients, queues, strict=True)]


def open_clients(spec: JobSpec, open_sites: frozenset[str] | None) -> frozenset[int] | None:
    """The clients whose site can train now (None: the job has no sites, or nobody knows)."""
    if spec.sites is None or open_sites is None:
        return None
    return frozenset(c for n, cs in spec.sites.items() if n in open_sites for c in cs)
