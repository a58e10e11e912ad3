"""Bulyan (El Mhamdi et al. 2018, "The Hidden Vulnerability of Distributed Learning in
Byzantium", ICML, arXiv:1802.07927). Needs n >= 4f + 3.

1. Selection: theta = n - 2f times, take the Krum winner among the updates not yet
   taken (Krum over the remaining set R, ties to the lower index).
2. Aggregation: per coordinate, average the beta = theta - 2f values of the selected
   updates closest to their median.

Convention for the last picks. Krum's score sums the distances to the |R| - f - 2
nearest others; the last pick of step 1 happens with |R| = 2f + 1 updates left, and
whenever |R| <= f + 2 that count is zero or less (for f = 1, at the fifth pick, with 3
left): every score would be 0 and the pick arbitrary. The paper's Algorithm (step 1,
"using A = Krum") does not define this case. fedq sums over max(1, |R| - f - 2)
neighbours: the update closest to another remaining update wins, which keeps Krum's
intent (pick from the densest region) and never lets an outlier win for being far from
everything, which a sum over all distances can. tests/test_robust.py pins the choice
on a case where the two conventions differ.
"""

from __future__ import annotations

import torch

from fedq.aggregate.reducers.base import (
    DEFAULT_CHUNK,
    REDUCERS,
    SourceReducer,
    UpdateSource,
    coordinatewise,
)
from fedq.aggregate.reducers.krum import Krum, krum_scores, pairwise_sq_distances
from fedq.aggregate.types import Weights


def bulyan_select(dist: torch.Tensor, f: int) -> list[int]:
    """Indices of the theta = n - 2f updates that step 1 selects, sorted."""
    n = dist.shape[0]
    if n < 4 * f + 3:
        raise ValueError(f"bulyan needs n >= 4f + 3 (n={n}, f={f})")
    remaining = list(range(n))
    chosen: list[int] = []
    while len(chosen) < n - 2 * f:
        sub = dist[remaining][:, remaining]
        scores = krum_scores(sub, max(1, len(remaining) - f - 2))
        best = min(range(len(remaining)), key=lambda i: (float(scores[i]), remaining[i]))
        chosen.append(remaining.pop(best))
    return sorted(chosen)


def bulyan(source: UpdateSource, f: int, chunk: int = DEFAULT_CHUNK) -> Weights:
    selected = bulyan_select(pairwise_sq_distances(source, range(len(source)), chunk), f)
    keep = len(selected) - 2 * f

    def reduce(block: torch.Tensor) -> torch.Tensor:  # (theta, c)
        ordered, _ = torch.sort(block, dim=0)
        mid = (ordered[(len(selected) - 1) // 2] + ordered[len(selected) // 2]) / 2
        closest = torch.argsort((block - mid).abs(), dim=0)[:keep]  # (keep, c)
        return torch.gather(block, 0, closest).mean(dim=0)

    return coordinatewise(source, selected, chunk, reduce)


@REDUCERS.register("bulyan")
class Bulyan(SourceReducer):
    paper = "El Mhamdi et al. 2018, arXiv:1802.07927"

    Params = Krum.Params
    params: Krum.Params

    def problem(self, n: int) -> str | None:
        f = self.params.f
        return None if n >= 4 * f + 3 else f"needs at least 4f + 3 updates (n {n}, f {f})"

    def reduce(self, source: UpdateSource, chunk: int = DEFAULT_CHUNK) -> Weights:
        self.check(len(source))
        return bulyan(source, self.params.f, chunk)
