"""Which queue a batch goes to: the one expected back soonest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Router:
    """Which queue a batch goes to: the live queue expected to answer soonest.

    Each queue's expected time is the moving average of its batches' round trips (sent
    to answered), scaled by its batches out per live worker, so a loaded GPU queue
    gives way to an idle CPU one and takes batches again as its backlog clears. A live
    queue measured fewer than twice takes the next batch (the faster class first: a GPU
    worker that came is tried at once); its first round trip, which includes loading the
    model, is replaced by its second rather than averaged in (a cold first batch would
    otherwise keep a fast queue looking slow until probes wore it down); every
    ``PROBE_EVERY``-th batch goes to the live queue measured longest ago, so that an
    estimate does not go stale. A batch with no answer counts as the whole timeout. Ties
    go to the faster class (gpu_new, gpu_sm61, cpu)."""

    order: list[str]  # the served queues, fastest class first
    live: dict[str, int] = field(default_factory=dict)  # queue -> live workers
    slots: dict[str, int] = field(default_factory=dict)  # queue -> their tasks at once
    ewma: dict[str, float] = field(default_factory=dict)  # queue -> seconds a batch
    measured: dict[str, int] = field(default_factory=dict)  # queue -> batch no. of last
    samples: dict[str, int] = field(default_factory=dict)  # queue -> round trips measured
    out: dict[str, int] = field(default_factory=dict)  # queue -> batches out
    sent: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # queue -> batches sent

    ALPHA = 0.3
    PROBE_EVERY = 20
    WARM = 2  # round trips before a queue's estimate is compared; the first is replaced

    def expected(self, queue: str) -> float:
        return self.ewma[queue] * (1 + self.out.get(queue, 0) / max(self.live.get(queue, 1), 1))

    def candidates(self) -> list[str]:
        return [q for q in self.order if self.live.get(q)] or self.order[:1]

    def best(self) -> str:
        """The queue the next batch would go to, apart from probes."""
        candidates = self.candidates()
        unmeasured = [q for q in candidates if self.samples.get(q, 0) < self.WARM]
        if unmeasured:  # measured warm before anything is compared (fastest class first)
            return unmeasured[0]
        return min(candidates, key=self.expected)  # ties: the faster class (order)

    def choose(self) -> str:
        """The queue for the next batch (counted as out until :meth:`done`)."""
        self.sent += 1
        candidates = self.candidates()
        queue = self.best()
        if self.sent % self.PROBE_EVERY == 0 and len(candidates) > 1:
            others = [q for q in candidates if q != queue]
            queue = min(others, key=lambda q: self.measured.get(q, -1))
        self.out[queue] = self.out.get(queue, 0) + 1
        self.counts[queue] = self.counts.get(queue, 0) + 1
        return queue

    def done(self, queue: str, seconds: float) -> None:
        """A batch sent to ``queue`` came back after ``seconds`` (or failed: the timeout)."""
        self.out[queue] = max(self.out.get(queue, 0) - 1, 0)
        self.samples[queue] = self.samples.get(queue, 0) + 1
        before = self.ewma.get(queue)
        self.ewma[queue] = seconds if before is None or self.samples[queue] <= self.WARM \
            else (1 - self.ALPHA) * before + self.ALPHA * seconds
        self.measured[queue] = self.sent

    def to_json(self) -> dict[str, Any]:
        return {q: {"live_workers": self.live.get(q, 0), "slots": self.slots.get(q, 0),
                    "batches": self.counts.get(q, 0),
                    "out": self.out.get(q, 0),
                    "batch_s": round(self.ewma[q], 4) if q in self.ewma else None}
                for q in self.order}
