"""A compressed downlink: each new global model also published as an int8 step from the
one before it, so a worker that holds the previous model downloads ~1/4 of the bytes.

With ``compression: {downlink: int8}`` the coordinator *defines* the next global model
as the previous one plus the dequantized step::

    step      = (new - previous) + residual          # float32, per floating tensor
    q, scales = quantize_int8(step)                   # compression.quantize_int8
    published = previous + dequantize_int8(q, scales)
    residual  = step - dequantize_int8(q, scales)     # error feedback, kept for next time

``new`` is what the server optimizer made; what it left out of ``published`` is kept
in the server state (``downlink.residual/NAME``) and added to the next step, so
quantization delays part of a step by a round instead of losing it (error feedback,
as in DoubleSqueeze, Tang et al. 2019, arXiv:1905.05957). The full ``published`` model
is stored as well, as always: workers without the previous model, evaluation, resume
and ``fedq generate`` read it.

A worker rebuilds ``published`` from the previous model with the same two float32 CPU
operations (an IEEE multiply and add, bit-exact on every machine) and checks the result
against :func:`content_digest` written into the step's metadata; the step blob itself
is checked against the digest its ref carries, like every blob. Any mismatch: the
worker downloads the full model instead. A tensor the round did not change is not in
the step at all (with Streaming DiLoCo a step carries one fragment); the content hash
covers the whole rebuilt model, so a tensor wrongly left out fails it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

import torch

import fedq.digest as digests
from fedq.aggregate.compression import Q_SUFFIX, S_SUFFIX, dequantize_int8, quantize_int8
from fedq.aggregate.types import Weights
from fedq.errors import UpdateRejected

RESIDUAL = "downlink.residual/"
CODEC = "int8-step"  # float32 tensors as int8 steps
PART = "part"  # the changed tensors whole (Streaming DiLoCo without a compressed downlink)


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[Weights, Weights]:
    """(the server optimizer's own state, the downlink residual by tensor name)."""
    own = {k: v for k, v in state.items() if not k.startswith(RESIDUAL)}
    residual = {k[len(RESIDUAL):]: v for k, v in state.items() if k.startswith(RESIDUAL)}
    return own, residual


def _stepped(value: torch.Tensor) -> bool:
    return value.dtype == torch.float32


def compress_step(previous: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor],
                  residual: Mapping[str, torch.Tensor], chunk: int, *,
                  quantize: bool = True) -> tuple[Weights, Weights, Weights, dict[str, str]]:
    """(published model, new residual, step tensors to store, their metadata).

    float32 tensors travel as int8 steps; any other tensor (integer counters, half
    precision) travels whole and is published as ``new`` has it. A tensor the server did
    not change (Streaming DiLoCo's other fragments) is left out of the step and keeps
    its residual for the round that changes it. ``quantize=False``: every changed
    tensor travels whole, so the step is exact (Streaming DiLoCo's fragment, fp32)."""
    published: Weights = {}
    left: Weights = {}
    stored: Weights = {}
    for name, value in new.items():
        base = previous.get(name)
        if base is not None and (value is base or (base.dtype == value.dtype and
                                                   base.shape == value.shape and
                                                   torch.equal(value, base))):
            published[name] = base
            if name in residual:
                left[name] = residual[name]
            continue
        if not quantize or not _stepped(value) or base is None or \
                base.dtype != value.dtype or base.shape != value.shape:
            published[name] = stored[name] = value
            continue
        step = value - base
        if name in residual:
            step = step + residual[name]
        q, scales = quantize_int8(step, chunk)
        applied = dequantize_int8(q, scales, tuple(value.shape), chunk)
        published[name] = base + applied
        left[name] = step - applied
        stored[name + Q_SUFFIX], stored[name + S_SUFFIX] = q, scales
    meta = {"fedq.codec": CODEC if quantize else PART, "fedq.chunk": str(chunk),
            "fedq.content": content_digest(published)}
    return published, left, stored, meta


def apply_step(previous: Mapping[str, torch.Tensor], stored: Mapping[str, torch.Tensor],
               meta: Mapping[str, str]) -> Weights:
    """The published model from the previous one and a step blob's tensors, checked
    against the content hash the coordinator wrote. Raises UpdateRejected otherwise."""
    if meta.get("fedq.codec") not in (CODEC, PART) or "fedq.content" not in meta:
        raise UpdateRejected(f"not a model step (codec {meta.get('fedq.codec')!r})")
    chunk = int(meta.get("fedq.chunk", "256"))
    out: Weights = {}
    for name in stored:
        if name.endswith(S_SUFFIX):
            continue
        if name.endswith(Q_SUFFIX):
            plain = name[:-len(Q_SUFFIX)]
            base = previous.get(plain)
            if base is None or plain + S_SUFFIX not in stored:
                raise UpdateRejected(f"step for {plain!r}: no previous tensor or no scales")
            out[plain] = base + dequantize_int8(stored[name], stored[plain + S_SUFFIX],
                                                tuple(base.shape), chunk)
        else:
            out[name] = stored[name]
    for name, base in previous.items():  # not in the step: unchanged (the hash checks it)
        out.setdefault(name, base)
    digest = content_digest(out, like=meta["fedq.content"])
    if digest != meta["fedq.content"]:
        raise UpdateRejected(f"rebuilt model's content hash {digests.short(digest)}... is "
                             f"not {digests.short(meta['fedq.content'])}...")
    return out


def content_digest(weights: Mapping[str, torch.Tensor], like: str | None = None) -> str:
    """A digest over the tensors in name order: each name, dtype and shape, then its
    bytes (independent of how a file lays them out or what metadata it carries). BLAKE3
    as blobs are (fedq/digest.py), or the hash of ``like``, the digest it is checked
    against (SHA-256 in a step written before)."""
    h = digests.new(like)
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        if t.numel():
            h.update(memoryview(cast(Any, t.reshape(-1).view(torch.uint8).numpy())))
    return digests.text(h)
