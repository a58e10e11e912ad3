"""Will a job's model fit where it must be kept? Checked at submit, before anything is
written, so that a model too large for the blob store or for the control worker is one
line with its numbers instead of a socket error or an out-of-memory kill mid-round.

Three limits, each where it is known:

- the blob store's largest blob (:meth:`~fedq.blobs.base.BlobStore.max_blob_bytes`:
  Redis's 512 MiB value, or its most chunks; S3's most parts of a multipart upload);
- the room the store's server leaves (:meth:`~fedq.blobs.base.BlobStore.room`: Redis's
  ``maxmemory``). A synchronous job keeps every round's global model (a resumed or
  reported job reads them) and one round's updates until its settle: ``rounds + 1``
  globals and ``clients_per_round`` updates (a buffered job: ``buffer`` more), each at
  most the global's size;
- the control worker's memory, where ``FEDQ_CONTROL_MEMORY_MB`` says how much it may use.
  Aggregating holds about :data:`HELD_COPIES` copies of the model (the global model, the
  update being read, the accumulator, the new global's bytes), or :data:`LEAN_COPIES`
  where the commit is lean (fedq/coordinator/lean.py: the accumulator alone, and a
  few of the pieces the store reads at once), and the server optimizer's state (DiLoCo's and
  FedAvgM's momentum: one copy; FedAdam, FedYogi, FedAdagrad: two; a lean commit holds
  it for one tensor at a time, the largest counted), on top of the
  :data:`PROCESS_BYTES` a control worker holds with no model (docs/benchmarks.md,
  "Large models").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fedq.aggregate.server import make_server
from fedq.blobs.base import BlobStore
from fedq.coordinator import lean
from fedq.errors import SpecError
from fedq.settings import Settings
from fedq.spec import JobSpec

MB = 2**20
#: Copies of the model the control worker holds while it aggregates.
HELD_COPIES = 4
#: Copies of the model a lean commit holds (the accumulator), pieces besides.
LEAN_COPIES = 1
#: What a control worker holds before any model (the 50 MB row of the large-model table).
PROCESS_BYTES = 768 * MB


class DoesNotFit(SpecError):
    """A job's model is larger than a store or the control worker can hold."""


@dataclass(frozen=True)
class Need:
    """What a job asks of the store and of the control worker, in bytes."""

    blob: int  # the global model as one blob
    store: int  # what the store keeps at the job's busiest moment
    control: int  # what the control worker holds while it aggregates
    state_copies: int  # of those, copies of the model that are server optimizer state
    held: int = HELD_COPIES  # of those, copies of the model aggregation holds
    state_bytes: int = 0  # a lean commit's state instead: one tensor's (the largest's)


def need(spec: JobSpec, blob_bytes: int, piece_bytes: int | None = None,
         largest: int = 0) -> Need:
    """What ``spec``'s job needs with a global model of ``blob_bytes`` bytes, whose
    largest tensor has ``largest`` elements, on a store that reads at most
    ``piece_bytes`` at once (``BlobStore.piece_bytes``)."""
    copies = state_copies(spec)
    if lean.applies(spec, piece_bytes, blob_bytes):  # its state: a tensor at a time
        return Need(blob=blob_bytes, store=_stored(spec, blob_bytes),
                    control=PROCESS_BYTES + piece_slack(piece_bytes, LEAN_COPIES)
                    + blob_bytes * LEAN_COPIES + copies * 4 * largest, state_copies=0,
                    held=LEAN_COPIES, state_bytes=copies * 4 * largest)
    held = HELD_COPIES
    return Need(blob=blob_bytes, store=_stored(spec, blob_bytes),
                control=PROCESS_BYTES + blob_bytes * (held + copies), state_copies=copies,
                held=held)


def _stored(spec: JobSpec, blob_bytes: int) -> int:
    """What the job keeps in the store at its busiest (module docstring)."""
    updates = spec.clients_per_round  # a buffered job's: those out and a version's buffer
    if spec.aggregation.mode == "buffered":
        updates += spec.aggregation.buffer
    return blob_bytes * (spec.rounds + 1 + updates)


def piece_slack(piece_bytes: int | None, held: int) -> int:
    """The pieces a lean commit holds besides the model: one being read, one read
    ahead, and the header's (none otherwise: the copies count them)."""
    return 3 * piece_bytes if piece_bytes is not None and held == LEAN_COPIES else 0


def state_copies(spec: JobSpec) -> int:
    """How many tensors of state the job's server optimizer keeps per model tensor (its
    own :meth:`update` on a one-element tensor, twice, says)."""
    server = make_server(spec.server.name, spec.server.params())
    state: dict[str, torch.Tensor] = {}
    for _ in range(2):
        _, state = server.update(torch.ones(1), state)
    return len(state)


def check(settings: Settings, spec: JobSpec, store: BlobStore, blob_bytes: int,
          shipped: tuple[int, ...] = (), largest: int = 0) -> Need:
    """``spec``'s :class:`Need`; raises :class:`DoesNotFit` with one line of numbers when
    it is over a limit of ``store`` or of ``FEDQ_CONTROL_MEMORY_MB``. ``shipped``: the
    sizes of the checkpoint files the job puts in the store beside (``ship_base``);
    ``largest``: the elements of the model's largest tensor."""
    got = need(spec, blob_bytes, store.piece_bytes, largest)
    got = dataclasses.replace(got, store=got.store + sum(shipped))
    most = store.max_blob_bytes()
    if most is not None and shipped and max(shipped) > most:
        raise DoesNotFit(
            f"ship_base: a checkpoint file is {_mb(max(shipped))} MB and blob store "
            f"{store.url} keeps at most {_mb(most)} MB a blob ({store.layout()}): raise "
            "FEDQ_BLOB_CHUNK_MB, or give every worker the checkpoint at model_args.path")
    if most is not None and got.blob > most:
        raise DoesNotFit(
            f"the model is {_mb(got.blob)} MB as a blob and blob store {store.url} keeps "
            f"at most {_mb(most)} MB a blob ({store.layout()}): raise FEDQ_BLOB_CHUNK_MB "
            "or use a smaller model")
    room = store.room()
    if room is not None and got.store > room[0]:
        raise DoesNotFit(
            f"the job keeps up to {_mb(got.store)} MB in the blob store ({spec.rounds + 1} "
            f"global models and a round's updates, {_mb(got.blob)} MB each"
            + (f", and its {_mb(sum(shipped))} MB checkpoint" if shipped else "")
            + f") and {room[1]}: "
            "fewer rounds, a smaller model, or a store with more room")
    limit = settings.control_memory_mb
    slack = piece_slack(store.piece_bytes, got.held)
    if limit is not None and got.control > limit * MB:
        state = f", {got.state_copies} of them {spec.server.name}'s state" \
            if got.state_copies else ""
        copies = got.held + got.state_copies
        raise DoesNotFit(
            f"aggregating needs about {_mb(got.control)} MB on the control worker "
            f"({copies} cop{'y' if copies == 1 else 'ies'} of the {_mb(got.blob)} MB "
            f"model{state}, "
            + (f"{_mb(got.state_bytes)} MB of {spec.server.name}'s state for its largest "
               "tensor, " if got.state_bytes else "")
            + (f"{_mb(slack)} MB of the pieces the store reads at once, " if slack else "")
            + f"and {_mb(PROCESS_BYTES)} MB of process) and FEDQ_CONTROL_MEMORY_MB allows "
            f"{limit:,.0f} MB: use a smaller model or LoRA (model_args.lora)")
    return got


def _mb(size: float) -> str:
    return f"{size / MB:,.0f}" if size >= 10 * MB else f"{size / MB:.2g}"
