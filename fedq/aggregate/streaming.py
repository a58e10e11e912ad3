"""Streaming DiLoCo: the model synchronised in F fragments at staggered rounds.

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512) splits the model into F
fragments and synchronises one of them at a time, so each exchange moves 1/F of the
model and the peak bandwidth falls by F. Every replica keeps training its own copy of
the whole model between exchanges; when fragment p is synchronised, the replicas send
their outer gradient for p alone (global_p - local_p, the change since p was last
synchronised), the server applies its outer optimizer to p alone, and each replica
replaces its copy of p with the new global p.

In fedq's rounds: round r synchronises fragment ``(r - 1) % F``; a round's inner steps
(``local_steps``) are the steps between two exchanges, so each fragment is synchronised
every F rounds (the paper's H is F x local_steps). Workers keep each client's replica
in ``FEDQ_HOME/inner/JOB/`` (fedq/worker/replica.py); the coordinator's global model is
the last synchronised value of every fragment.

Fragments follow the model's structure, as the paper's do: tensors whose name carries a
block index (``blocks.3.attn...``) belong to their block; everything else (embeddings,
the tied output head, the final norm) is one group, so tied weights stay together. The
groups are dealt to F fragments largest first, each to the fragment with the fewest
bytes so far (ties to the lowest index), which keeps the fragments about equally large
and is a pure function of the tensor names, shapes and dtypes, so the coordinator and
every worker compute the same fragments (whatever order the tensors come in). A model
with fewer groups than F fragments is split per tensor instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_BLOCK = re.compile(r"(?:^|\.)(\d+)\.")


def _groups(weights: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Tensor names grouped by block index, the rest as one group; the order depends on
    the names alone (a model read back from safetensors has its keys sorted)."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name in sorted(weights):
        match = _BLOCK.search(name)
        key = (name[:match.start(1)], int(match.group(1))) if match else ("", -1)
        groups.setdefault(key, []).append(name)
    return [groups[k] for k in sorted(groups)]


def fragments(weights: Mapping[str, torch.Tensor], count: int) -> list[tuple[str, ...]]:
    """The model's ``count`` fragments: tuples of tensor names, in state-dict order
    within each, every name in exactly one. Raises ValueError when the model has fewer
    tensors than fragments."""
    if count < 1:
        raise ValueError(f"fragments must be >= 1, not {count}")
    if len(weights) < count:
        raise ValueError(f"the model has {len(weights)} tensors, fewer than {count} fragments")
    groups = _groups(weights)
    if len(groups) < count:
        groups = [[name] for name in sorted(weights)]
    size = {name: t.numel() * t.element_size() for name, t in weights.items()}
    totals = [0] * count
    members: list[set[str]] = [set() for _ in range(count)]
    for group in sorted(groups, key=lambda g: -sum(size[n] for n in g)):  # stable sort
        target = min(range(count), key=lambda i: (totals[i], i))
        members[target].update(group)
        totals[target] += sum(size[n] for n in group)
    return [tuple(n for n in weights if n in m) for m in members]


def fragment_of_round(number: int, count: int) -> int:
    """The fragment synchronised in round ``number`` (1-based)."""
    return (number - 1) % count


def fragment_names(weights: Mapping[str, torch.Tensor], number: int, count: int
                   ) -> tuple[str, ...]:
    """The names of the tensors synchronised in round ``number``."""
    return fragments(weights, count)[fragment_of_round(number, count)]


def synced_between(first: int, last: int, count: int) -> set[int]:
    """Fragments synchronised in rounds ``first`` .. ``last`` (inclusive)."""
    if last < first:
        return set()
    return {fragment_of_round(r, count) for r in range(first, min(last, first + count - 1) + 1)}
