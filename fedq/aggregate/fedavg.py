"""Federated averaging (McMahan et al. 2017, "Communication-Efficient Learning of Deep
Networks from Decentralized Data", arXiv:1602.05629).

Clients send deltas (local - global). The server adds the sample-weighted mean of the
deltas to the global model:  w' = w + sum_i n_i * d_i / sum_i n_i.

The mean streams: it holds one float32 accumulator the size of the model and one
update at a time, so memory is O(model), not O(clients x model). An ``Accumulator``
keeps that memory from one round to the next: a fresh model-sized accumulator pays a
page fault per 4 kB page every round.

The accumulator is one contiguous buffer with a view per tensor. An update read from a
blob is views of one buffer too (fedq.weights.loads), laid out in the same order, so
each update is added with one vectorized add over the whole model rather than one
per tensor (ResNet-18 has 122 tensors, many of them small: the per-call cost was a
fifth of the time; docs/benchmarks.md, section 2). Tensors that are not laid out
back to back are added one by one, with the same result.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping

import torch

from fedq.aggregate.types import Weights


class Pieces(ABC):
    """An update that is never whole in memory: its tensors' names, shapes and dtypes
    up front, its values in flat pieces (the coordinator reads a big update from a
    scratch file this way, fedq/coordinator/receive.py)."""

    @abstractmethod
    def layout(self) -> Mapping[str, torch.Tensor]:
        """Empty ("meta") tensors with the update's names, shapes and dtypes, in order."""

    @abstractmethod
    def pieces(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(tensor name, first element, flat values): every element exactly once."""


def weighted_mean(updates: Iterable[tuple[float, Mapping[str, torch.Tensor] | Pieces]],
                  out: Weights | None = None, expected: float | None = None) -> Weights:
    """Sum_i w_i * u_i / sum_i w_i over an iterable of (weight, update), streamed. An
    update given as :class:`Pieces` is added piece by piece, with the same
    operations element by element (the same result, bit for bit).

    Every update must have the same names and shapes as the first (verify before).
    Accumulates in float32 (float64 for float64 tensors); the result is float32/64.
    ``out``: tensors to accumulate into when their names, shapes and dtypes are those
    the result would have (the result is then ``out`` itself, overwritten); otherwise
    new ones are allocated. ``expected``: what the weights should sum to, when the
    caller knows it before the updates are read: each update is then added already
    divided by it, and the pass that divides the sum at the end is made only if the
    weights did not sum to it after all (an update was refused on the way).
    Raises ValueError when there is no update or the weights sum to zero or less.
    """
    acc: Weights | None = None
    acc_breaks: set[int] = set()
    total = 0.0
    scale = 1.0 / expected if expected is not None and expected > 0 else 1.0
    for weight, update in updates:
        if weight < 0:
            raise ValueError(f"negative weight {weight}")
        if isinstance(update, Pieces):
            first = acc is None
            if acc is None:
                acc, acc_breaks = _fit(update.layout(), out)
            _add_pieces(acc, update, weight * scale, first)
        elif acc is None:  # the first update, scaled, starts the accumulator (one pass)
            acc, acc_breaks = _start(update, weight * scale, out)
        else:
            _add(acc, acc_breaks, update, weight * scale)
        total += weight
    if acc is None:
        raise ValueError("no updates to average")
    if total <= 0:
        raise ValueError("update weights sum to zero")
    if abs(total * scale - 1.0) > 1e-12:  # sum(w_i u_i) * scale / (total * scale)
        targets = list(acc.values())
        for lo, hi in _runs(len(targets), acc_breaks):
            _span(targets, lo, hi).div_(total * scale)
    return acc


class Accumulator(threading.local):
    """The memory of a mean, kept from one ``mean`` call to the next (one per thread).

    ``mean`` returns tensors that the next ``mean`` call in the same thread overwrites
    when the model's shapes are unchanged: use the result (or copy it) before then.
    ``release`` lets the memory go (a job is over).
    """

    def __init__(self) -> None:
        self.weights: Weights | None = None
        self.expected: float | None = None

    def expect(self, total: float) -> None:
        """The weights of the next ``mean`` should sum to ``total`` (finalize knows it
        from the results before it reads the updates): that mean then skips its last
        pass over the model when they do."""
        self.expected = total

    def mean(self, updates: Iterable[tuple[float, Mapping[str, torch.Tensor] | Pieces]]
             ) -> Weights:
        """``weighted_mean(updates)``, in the memory of the previous call where it fits."""
        out, self.weights = self.weights, None  # nothing kept if the mean raises
        expected, self.expected = self.expected, None
        self.weights = weighted_mean(updates, out=out, expected=expected)
        return self.weights

    def release(self) -> None:
        self.weights = None


def apply_delta(weights: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> Weights:
    """weights + delta, each result in the dtype of ``weights`` (integers rounded).
    A tensor ``delta`` does not name is kept as it is (a Streaming DiLoCo fragment's
    step names only the fragment's tensors)."""
    out: Weights = {}
    for name, value in weights.items():
        step = delta.get(name)
        if step is None:
            out[name] = value
            continue
        if value.dtype.is_floating_point:
            out[name] = (value.to(step.dtype) + step).to(value.dtype)
        else:  # integer buffers, e.g. BatchNorm's num_batches_tracked
            out[name] = (value.to(torch.float64) + step.to(torch.float64)).round().to(value.dtype)
    return out


def fedavg(weights: Mapping[str, torch.Tensor],
           deltas: Iterable[tuple[float, Mapping[str, torch.Tensor]]]) -> Weights:
    """The new global model: ``weights`` plus the weighted mean of ``deltas``."""
    return apply_delta(weights, weighted_mean(deltas))


def _fit(update: Mapping[str, torch.Tensor], out: Weights | None) -> tuple[Weights, set[int]]:
    """Accumulator tensors for updates shaped like ``update``: ``out`` where it fits,
    else new (one buffer for the float32 tensors, a view per tensor); and their
    breaks."""
    fits = out is not None and list(out) == list(update) and all(
        out[k].shape == v.shape and out[k].dtype == acc_dtype(v.dtype)
        and out[k].is_contiguous() for k, v in update.items())
    if out is None or not fits:
        out = _allocate(update)
    return out, _breaks(list(out.values()))


def _add_pieces(acc: Weights, update: Pieces, weight: float, first: bool) -> None:
    """acc (+)= weight * update, a piece at a time (``first``: acc starts from it)."""
    flat = {name: t.view(-1) for name, t in acc.items()}
    for name, start, piece in update.pieces():
        a = flat[name][start:start + piece.numel()]
        u = piece if piece.dtype == a.dtype else piece.to(a.dtype)
        if first:
            torch.mul(u, weight, out=a)
        else:
            a.add_(u, alpha=weight)


def _start(update: Mapping[str, torch.Tensor], weight: float,
           out: Weights | None) -> tuple[Weights, set[int]]:
    """The accumulator holding ``weight * update`` (:func:`_fit`'s memory); and its
    breaks."""
    out, acc_breaks = _fit(update, out)
    names = list(out)
    tensors = [update[n] for n in names]
    acc = [out[n] for n in names]
    for lo, hi in _runs(len(names), acc_breaks | _breaks(tensors)):
        a, u = _span(acc, lo, hi), _span(tensors, lo, hi)
        torch.mul(u if u.dtype == a.dtype else u.to(a.dtype), weight, out=a)
    return out, acc_breaks


def _allocate(update: Mapping[str, torch.Tensor]) -> Weights:
    """Accumulator tensors shaped like ``update``: the float32 ones views of one buffer."""
    flat = torch.empty(sum(v.numel() for v in update.values()
                           if acc_dtype(v.dtype) == torch.float32), dtype=torch.float32)
    out: Weights = {}
    offset = 0
    for name, v in update.items():
        if acc_dtype(v.dtype) == torch.float32:
            out[name] = flat[offset:offset + v.numel()].view(v.shape)
            offset += v.numel()
        else:
            out[name] = torch.empty(v.shape, dtype=acc_dtype(v.dtype))
    return out


def _add(acc: Weights, acc_breaks: set[int], update: Mapping[str, torch.Tensor],
         weight: float) -> None:
    """acc += weight * update, in place, one add per run of tensors that lie back to
    back in both."""
    targets = list(acc.values())
    tensors = [update[n] for n in acc]  # same names (verified before)
    for lo, hi in _runs(len(targets), acc_breaks | _breaks(tensors)):
        a, u = _span(targets, lo, hi), _span(tensors, lo, hi)
        a.add_(u if u.dtype == a.dtype else u.to(a.dtype), alpha=weight)


def _breaks(tensors: list[torch.Tensor]) -> set[int]:
    """The indices i where tensors[i] does not directly follow tensors[i - 1] in the
    same memory with the same dtype (so a span over both would be wrong)."""
    out = set()
    end, dtype, first = -1, None, 0
    for i, t in enumerate(tensors):
        ptr = t.data_ptr()
        if ptr != end or t.dtype != dtype or not t.is_contiguous():
            if i:
                out.add(i)
                _check_storage(tensors, first, i, out)
            first = i
            if not t.is_contiguous():  # never joined with the next one either
                out.add(i + 1)
        end, dtype = ptr + t.nbytes, t.dtype
    _check_storage(tensors, first, len(tensors), out)
    return out


def _check_storage(tensors: list[torch.Tensor], lo: int, hi: int, breaks: set[int]) -> None:
    """A run whose first and last tensors are in different storages (separate
    allocations that happen to be adjacent) is split into single tensors: a span from
    the first would reach past its storage. Both in one storage, the memory between
    them is that storage's too."""
    if hi - lo > 1 and tensors[lo].untyped_storage().data_ptr() \
            != tensors[hi - 1].untyped_storage().data_ptr():
        breaks.update(range(lo + 1, hi))


def _runs(count: int, breaks: set[int]) -> list[tuple[int, int]]:
    edges = [0, *sorted(b for b in breaks if 0 < b < count), count]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if lo < hi]


def _span(tensors: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """tensors[lo:hi] as one tensor: a flat view over their memory when there are
    several (the caller checked they lie back to back), else the tensor itself."""
    first = tensors[lo]
    if hi - lo == 1:
        return first
    last = tensors[hi - 1]
    count = (last.data_ptr() + last.nbytes - first.data_ptr()) // first.element_size()
    return first.as_strided((count,), (1,))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
