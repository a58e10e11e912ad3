"""One client update: what a training worker does with a :class:`~fedq.protocol.training.TrainRef`.

It fetches the global model (cached by its digest), derives its own data shard,
trains, uploads its delta under a deterministic key and returns an
:class:`~fedq.protocol.training.UpdateRef`. It never raises: a Celery chord whose header task
fails never runs its body, so failure is reported as an error ref.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

import fedq.digest as digests
from fedq.aggregate.compression import encode, meta_of, zstd_compress
from fedq.aggregate.downlink import apply_step
from fedq.aggregate.streaming import fragment_names
from fedq.aggregate.types import Weights
from fedq.blobs import BlobRef, BlobStore, global_key, update_key
from fedq.blobs.cache import HostCache
from fedq.blobs.presigned import PresignedStore
from fedq.data import client_indices, load_dataset
from fedq.errors import BlobError, TrainingDiverged, UpdateRejected
from fedq.models import build_model, seeded_model
from fedq.models.device import pick_device
from fedq.process import PROCESS
from fedq.protocol.training import MEASURE_UPLINK_BYTES, StepRef, TrainRef, TrainStats, UpdateRef
from fedq.redaction import redact_text
from fedq.settings import get_settings
from fedq.spec import JobSpec
from fedq.testing import faults, hold
from fedq.weights import (
    dump_parts,
    dump_stream,
    dumps,
    encoded_lazily,
    loads,
    loads_with_meta,
    raw_size,
    state_of,
)
from fedq.worker import fit, inner, owner, ranks, replica
from fedq.worker import kept as kept_file
from fedq.worker.loop import LocalStats, local_train

log = logging.getLogger(__name__)


def fetch_global(store: BlobStore, ref: BlobRef,
                 step: StepRef | None = None) -> tuple[Weights, int]:
    """The global model for ``ref`` and the bytes downloaded (0 when this process kept
    it, or another worker of this machine had put it in the FEDQ_BLOB_CACHE folder).
    A model larger than the store reads at once, with no step to follow, is the only
    one the process keeps: the one it held before is let go before the download.
    With a ``step`` from a model this process holds, only the step is downloaded and
    the model rebuilt from it (checked against its content hash; on any mismatch the
    full model is downloaded instead)."""
    kept = PROCESS.model(ref.sha256)
    if kept is not None:
        return kept, 0
    folder = get_settings().blob_cache
    base = PROCESS.model(step.base) if step is not None else None
    if step is not None and base is not None:
        try:
            data, downloaded = HostCache(folder).get(store, step.blob) if folder is not None \
                else (store.get(step.blob, limit=step.blob.size), True)
            stored, meta = loads_with_meta(data, what=f"blob {step.blob.key}")
            weights = apply_step(base, stored, meta)
        except (BlobError, UpdateRejected) as exc:
            log.warning("model step %s not usable (%s): downloading the full model",
                        step.blob.key, exc)
        else:
            PROCESS.keep_model(ref.sha256, weights)
            return weights, step.blob.size if downloaded else 0
    alone = step is None and store.piece_bytes is not None and ref.size > store.piece_bytes
    if alone:  # a big model with no step to come: the previous one is of no more use
        PROCESS.models.clear()
    whole: bytes | bytearray
    if folder is not None:
        whole, downloaded = HostCache(folder).get(store, ref)
    else:  # into one buffer, as it arrives
        whole, downloaded = store.get_buffer(ref, limit=ref.size), True
    weights = loads(whole, what=f"blob {ref.key}")
    PROCESS.keep_model(ref.sha256, weights, only=alone)
    return weights, ref.size if downloaded else 0


def here(spec: JobSpec, store: BlobStore) -> JobSpec:
    """``spec`` with paths that hold the job's checkpoint and tokenizer on this machine:
    its own copies, or those the job stores beside it (a shipped base, a tokenizer fedq
    submit trained), fetched once per machine into FEDQ_HOME (fedq/models/stored.py)."""
    from fedq.models.stored import beside, localized

    if not beside(spec.model_args, spec.dataset_args):
        return spec
    from fedq.blobs.checkpoint import fetcher

    model_args, dataset_args = localized(spec.model_args, spec.dataset_args,
                                         fetcher(store, get_settings().home))
    return spec.model_copy(update={"model_args": model_args, "dataset_args": dataset_args})


def rebuild_initial(ref: TrainRef, spec: JobSpec, input_shape: tuple[int, ...],
                    num_classes: int) -> Weights | None:
    """Round 0's global model rebuilt here from the spec's seed, if it is the stored blob
    byte for byte (its digest is the ref's); None otherwise, and the model is downloaded.

    The coordinator made that blob with the same call (``seeded_model``) and wrote it
    with the job id as its only metadata, so a worker with the same torch build gets
    the same bytes without moving them: on a slow link, a whole model's download saved
    per worker and job. Another torch build (other initialisers or RNG) gives other
    bytes, which the hash catches."""
    if ref.model.key != global_key(ref.job, 0) or PROCESS.model(ref.model.sha256) is not None:
        return None
    weights = state_of(seeded_model(spec.model, input_shape, num_classes, spec.seed,
                                    **spec.model_args))
    digest = digests.new(ref.model.sha256)  # the stored blob's hash
    for part in dump_parts(weights, {"job": ref.job}):
        digest.update(part)
    if digests.text(digest) != ref.model.sha256:
        log.info("round 0's model rebuilt from the seed differs from the stored one: "
                 "downloading it")
        return None
    PROCESS.keep_model(ref.model.sha256, weights)
    return weights


def pick_codec(spec: JobSpec) -> tuple[str, float | None]:
    """The update codec for this worker and the uplink speed (Mbit/s) it was picked
    for: ``codec: auto`` sends int8 over an uplink slower than ``slow_link_mbit``."""
    uplink = get_settings().uplink_mbit or PROCESS.uplink_mbit
    codec = spec.compression.codec
    if codec != "auto":
        return codec, uplink
    if uplink is None:  # not measured yet: fp32, and this upload measures it
        return "none", None
    return ("int8" if uplink < spec.compression.slow_link_mbit else "none"), uplink


def client_seed(seed: int, round_number: int, client: int) -> int:
    return (seed * 1_000_003 + round_number * 10_007 + client) % (2**63)


def run_training(data: dict, store: BlobStore, worker: str,
                 revoked: Callable[[], str | None] | None = None) -> dict:
    """Train one client for one round; always returns an UpdateRef as JSON.
    ``revoked``: asked before each step, why the task must stop now (its job was
    cancelled or ended: the heartbeat's :meth:`~fedq.worker.heartbeat.Heartbeat.stopped`);
    a reason ends training there, answered as an error that names it."""
    start, wall = time.perf_counter(), time.time()
    try:
        ref = TrainRef.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:  # FormatError is a ValueError
        log.warning("refused a malformed task: %s", exc)
        return refusal(data, worker, f"malformed task: {exc}")
    try:
        result = _train(ref, store, worker, start, revoked)
        result = dataclasses.replace(result, stats=dataclasses.replace(result.stats,
                                                                       started=wall))
        log.info("trained: %d samples, %d steps, loss %s, %.2fs (download %.2fs, train "
                 "%.2fs, upload %.2fs)", result.samples, result.steps,
                 "-" if result.loss is None else f"{result.loss:.4f}", result.seconds,
                 result.stats.download_seconds, result.stats.train_seconds,
                 result.stats.upload_seconds)
        return result.to_json()
    except Revoked as exc:  # nobody reads this answer: say why it stopped
        log.warning("stopped: %s", exc)
        return refusal(data, worker, str(exc))
    except Yielded as exc:  # the owner needs the machine: not a failure, sent elsewhere
        log.warning("yielded: %s", exc)
        return UpdateRef(status="yielded", job=ref.job, round=ref.round, task=ref.task,
                         client=ref.client, queue=ref.queue, worker=worker,
                         seconds=time.perf_counter() - start, attempt=ref.attempt,
                         gen=ref.gen, stats=TrainStats(started=wall),
                         error=str(exc)[:2000]).to_json()
    except Exception as exc:  # reported as data, never thrown through the chord
        log.warning("training failed: %s: %s", type(exc).__name__, exc)
        return UpdateRef(status="error", job=ref.job, round=ref.round, task=ref.task,
                         client=ref.client,
                         queue=ref.queue, worker=worker, seconds=time.perf_counter() - start,
                         attempt=ref.attempt, gen=ref.gen, stats=TrainStats(started=wall),
                         error=redact_text(f"{type(exc).__name__}: {exc}")[:2000]).to_json()


def _on_devices(ref: TrainRef, spec: JobSpec, model: torch.nn.Module, x: torch.Tensor,
                y: torch.Tensor, where: list[torch.device], seed: int,
                stop: Callable[[], str | None]) -> LocalStats:
    """The task's training over ``where``, this machine's devices, data-parallel
    (fedq/worker/ranks.py); ValueError with one line for what ranks do not do yet."""
    if spec.time_budget_s is not None:
        raise ValueError(f"time_budget_s: this worker trains over {len(where)} devices "
                         "(FEDQ_DEVICES), which take a fixed number of steps: drop the "
                         "budget or run the worker on one device")
    home = get_settings().home
    kwargs = {"batch_size": spec.batch_size, "epochs": spec.local_epochs,
              "steps": spec.local_steps, "seed": seed, "prox_mu": spec.prox_mu,
              "first_step": (ref.round - 1) * (spec.local_steps or 0),
              "schedule_steps": spec.schedule_steps,
              "schedule_window": spec.schedule_window(ref.round),
              "state_path": str(inner.state_path(home, ref.job, ref.client))
              if spec.optimizer.keep_state else None,
              "task": f"{ref.job}-r{ref.number}-c{ref.client}-a{ref.attempt}"}
    log.info("training over %d devices: %s", len(where), ", ".join(map(str, where)))
    return ranks.train(model, x, y, where, {"spec": spec.to_json(), "client": ref.client,
                                            "seed": seed}, spec.optimizer, kwargs, stop)


def refusal(data: Any, worker: str, reason: str) -> dict:
    """The error result of a task this worker refused (malformed, or its seal does not
    hold: fedq/identity.py), echoing only the fields that have the right types."""
    fields = data if isinstance(data, dict) else {}
    return UpdateRef(status="error", job=_echo(fields.get("job"), "?", 32),
                     round=_echo(fields.get("round"), 0), task=_echo(fields.get("task"), 0),
                     client=_echo(fields.get("client"), 0),
                     queue=_echo(fields.get("queue"), "?", 32), worker=worker,
                     attempt=max(1, _echo(fields.get("attempt"), 1)),
                     gen=_echo(fields.get("gen"), 0),
                     error=redact_text(reason)[:2000]).to_json()


def _echo(value: object, default: Any, length: int = 0) -> Any:
    """A field of a refused task, echoed in the error result only if it has the right
    type (an int in range; a string cut to ``length``), else ``default``."""
    if isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
        return value if ok else default
    return value[:length] if isinstance(value, str) and value else default


class Yielded(Exception):
    """The task stopped for the machine's owner before it had enough to send."""


class Revoked(Exception):
    """The task was revoked while it trained (its job was cancelled or ended)."""


def _train(ref: TrainRef, store: BlobStore, worker: str, start: float,
           revoked: Callable[[], str | None] | None = None) -> UpdateRef:
    spec = JobSpec.stored(ref.spec)
    why = owner.away()
    if why is not None:  # taken just as the owner came back: hand it on untouched
        raise Yielded(f"{why}: not started")
    if faults.zero_compute(spec.name):  # benchmarks only (fedq/testing/faults.py)
        fetched = time.perf_counter()
        global_weights, bytes_down = fetch_global(store, ref.model, ref.step)
        return _zero_compute(ref, spec, store, worker, start, global_weights, bytes_down,
                             time.perf_counter() - fetched)
    spec = here(spec, store)
    ds = load_dataset(spec.dataset, spec.data_dir, spec.dataset_args)
    fetched = time.perf_counter()
    rebuilt = rebuild_initial(ref, spec, ds.input_shape, ds.num_classes)
    global_weights, bytes_down = (rebuilt, 0) if rebuilt is not None else \
        fetch_global(store, ref.model, ref.step)
    download = time.perf_counter() - fetched
    idx = torch.from_numpy(client_indices(ds.partition_labels(), spec.partition,
                                          spec.num_clients, ref.client, spec.seed))
    seed = client_seed(spec.seed, ref.number, ref.client)
    torch.manual_seed(seed)
    model = build_model(spec.model, ds.input_shape, ds.num_classes, **spec.model_args)
    settings = get_settings()
    device = pick_device()
    fit.check(model, spec.optimizer, device, settings.train_memory_mb,
              settings.gpu_memory_fraction)
    streaming, mixing = (spec.streaming.fragments, spec.streaming.mixing) if spec.streaming \
        else (0, 0.0)
    home = settings.home
    kept_at = replica.replica_path(home, ref.job, ref.client)
    if streaming:  # Streaming DiLoCo: train on from this client's own replica
        start_weights, kept = replica.start_from(global_weights, kept_at, ref.round,
                                                 streaming, mixing)
        log.info("streaming: %d of %d fragments from the kept replica", kept, streaming)
        model.load_state_dict(start_weights)
    else:
        model.load_state_dict(global_weights)
    key = (ref.job, ref.client, ref.model.sha256)
    resume = PROCESS.kept.pop(key, None)  # it yielded here before: go on from there
    on_disk = settings.leave_in_memory and settings.leave_on_disk
    if resume is not None:
        log.info("resuming: %d steps kept in memory since it yielded", resume.step)
        if on_disk:
            kept_file.drop(home, key)
    elif on_disk:  # a worker restarted since
        resume = kept_file.load(home, key)
        if resume is not None:
            log.info("resuming: %d steps kept on disk since it yielded", resume.step)
    log.info("training: client %d, round %d of job %s", ref.client, ref.round, ref.job)
    stop = owner.away if revoked is None else lambda: revoked() or owner.away()
    where = ranks.devices(settings.devices)
    if len(where) > 1:  # this machine's devices together (FEDQ_DEVICES)
        stats = _on_devices(ref, spec, model, ds.x_train[idx], ds.y_train[idx], where, seed,
                            stop)
    else:
        stats = local_train(
            model, ds.x_train[idx], ds.y_train[idx], optimizer=spec.optimizer,
            batch_size=spec.batch_size, epochs=spec.local_epochs, steps=spec.local_steps,
            seed=seed, device=device, time_budget=spec.time_budget_s, prox_mu=spec.prox_mu,
            first_step=(ref.round - 1) * (spec.local_steps or 0),
            schedule_steps=spec.schedule_steps,
            schedule_window=spec.schedule_window(ref.round),
            state_path=inner.state_path(home, ref.job, ref.client)
            if spec.optimizer.keep_state else None, should_stop=stop, resume=resume)
    if stats.yielded is not None and revoked is not None and (why := revoked()) is not None:
        raise Revoked(f"revoked while it trained, after {stats.steps} of "
                      f"{stats.planned_steps} steps: {why}")
    if stats.yielded is not None and \
            stats.steps < max(1, math.ceil(settings.partial_min * stats.planned_steps)):
        if stats.kept is not None and settings.leave_in_memory:
            PROCESS.keep_task(key, stats.kept)
            if on_disk:
                try:
                    kept_file.save(home, key, stats.kept)
                except (OSError, TypeError, ValueError) as exc:  # memory still has it
                    log.warning("fedq: could not keep the task on disk (%s)", exc)
        raise Yielded(f"{stats.yielded}: after {stats.steps} of {stats.planned_steps} steps"
                      + (f" ({stats.resumed_steps} of them kept from before)"
                         if stats.resumed_steps else ""))
    if stats.loss is not None and not math.isfinite(stats.loss):  # nothing worth sending
        raise TrainingDiverged(
            f"training diverged: mean loss {stats.loss} over {stats.steps} steps "
            f"(optimizer {spec.optimizer.name}, lr {spec.optimizer.lr}: try a smaller lr)")
    local = model.state_dict()
    base = global_weights
    if streaming:  # the outer gradient of this round's fragment alone
        replica.save(local, kept_at, ref.round)
        base = {k: global_weights[k] for k in fragment_names(global_weights, ref.round,
                                                             streaming)}
    delta = {name: local[name].detach().cpu().float() - value.float()
             if not value.dtype.is_floating_point
             else local[name].detach().cpu() - value
             for name, value in base.items()}
    scale = faults.byzantine_scale(spec.name, ref.client)  # tests only (fedq/testing/faults.py)
    if scale is not None:
        delta = {k: v * scale if v.dtype.is_floating_point else v for k, v in delta.items()}
    up, upload, sent = _upload(ref, spec, store, delta, worker)
    return UpdateRef(status="ok", job=ref.job, round=ref.round, task=ref.task,
                     client=ref.client,
                     queue=ref.queue, worker=worker, key=up.key, sha256=up.sha256,
                     samples=stats.samples, steps=stats.steps, loss=stats.loss,
                     seconds=time.perf_counter() - start, bytes_up=up.size,
                     bytes_down=bytes_down, attempt=ref.attempt, gen=ref.gen,
                     stats=TrainStats(seen=stats.seen, train_seconds=stats.seconds,
                                      raw_bytes=raw_size(delta),
                                      stopped_by_budget=stats.stopped_by_budget, amp=stats.amp,
                                      yielded=stats.yielded is not None,
                                      device=stats.device, gpu_peak_mb=stats.gpu_peak_mb,
                                      gpu_util=stats.gpu_util, host_peak_mb=peak_rss_mb(),
                                      tokens=stats.seen * ds.x_train.shape[1]
                                      if ds.is_text else 0,
                                      download_seconds=download, upload_seconds=upload,
                                      codec=sent.codec, uplink_mbit=sent.uplink_mbit))


def peak_rss_mb() -> float | None:
    """The peak resident memory of this process since it started, in MB (None where the
    system does not say: ``ru_maxrss`` is in KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if peak <= 0:
        return None
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _upload(ref: TrainRef, spec: JobSpec, store: BlobStore, delta: Mapping[str, torch.Tensor],
            worker: str) -> tuple[BlobRef, float, TrainStats]:
    """Encode and store ``delta``: its ref, the seconds it took, and the codec it was
    sent with and this worker's uplink as the task's stats report them. A large upload
    measures the uplink (the put alone, not the encoding). The update is written
    tensor by tensor as the store takes it, each tensor encoded then, unless zstd
    compresses the whole (a ``LazyWeights`` delta is then never whole in memory)."""
    def after_chunk(written: int) -> None:
        if written == 1:  # fault tests only (FEDQ_TEST_HOLD): a chunked upload half done
            hold.at("upload", f"upload-{ref.job}-r{ref.number}-c{ref.client}-a{ref.attempt}",
                    worker)

    codec, _ = pick_codec(spec)
    started = time.perf_counter()
    said = {"job": ref.job, "round": str(ref.round), "task": str(ref.task),
            "client": str(ref.client)}
    key = store.upload_key if isinstance(store, PresignedStore) else \
        update_key(ref.job, ref.number, ref.client, ref.attempt, get_settings().joined_as)
    chunk = spec.compression.chunk
    if not spec.compression.zstd:  # written as the tensors come, each encoded then
        size, stream = dump_stream(encoded_lazily(delta, codec, chunk),
                                   {**meta_of(codec, chunk), **said})
        sending = time.perf_counter()
        up = store.put_stream(key, size, stream, after_chunk)
    else:
        stored, meta = encode(delta, codec, chunk)
        meta.update(said)
        parts = [zstd_compress(dumps(stored, meta))]
        sending = time.perf_counter()
        up = store.put_parts(key, parts, after_chunk)
    done = time.perf_counter()
    if up.size >= MEASURE_UPLINK_BYTES:  # the put alone: the link, not the encoder
        PROCESS.uplink_mbit = up.size * 8 / max(done - sending, 1e-6) / 1e6
    return up, done - started, TrainStats(codec=codec, uplink_mbit=PROCESS.uplink_mbit
                                          or get_settings().uplink_mbit)


def _zero_compute(ref: TrainRef, spec: JobSpec, store: BlobStore, worker: str, start: float,
                  global_weights: Weights, bytes_down: int, download: float) -> UpdateRef:
    """A zero-compute job's task (``FEDQ_TEST_ZERO_COMPUTE``, fedq/testing/faults.py): no
    data, no model, no training; the update is :func:`fedq.testing.faults.zero_delta`."""
    delta = faults.zero_delta(tuple((k, tuple(v.shape), v.dtype)
                                    for k, v in global_weights.items()), ref.client)
    del global_weights  # (kept by the process for the next round, if it may be)
    up, upload, sent = _upload(ref, spec, store, delta, worker)
    return UpdateRef(status="ok", job=ref.job, round=ref.round, task=ref.task,
                     client=ref.client,
                     queue=ref.queue, worker=worker, key=up.key, sha256=up.sha256,
                     samples=1, steps=0, loss=0.0, seconds=time.perf_counter() - start,
                     bytes_up=up.size, bytes_down=bytes_down, attempt=ref.attempt,
                     gen=ref.gen, stats=TrainStats(seen=1, raw_bytes=raw_size(delta.outline),
                                                   download_seconds=download,
                                                   upload_seconds=upload, codec=sent.codec,
                                                   uplink_mbit=sent.uplink_mbit))
