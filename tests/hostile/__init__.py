"""A hostile training worker, for tests/test_security.py only.

``celery -A tests.hostile worker -Q gpu_new`` runs fedq's own Celery app with
:func:`fedq.worker.update.run_training` wrapped: the worker trains honestly, then does
the one attack its job is named after (spec ``name: attack-<scenario>``) to the
result, the uploaded blob, the broker or the backend. It lives in tests/, so no
production worker (``celery -A fedq``) can import it.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

import fedq.worker.update as update
from fedq.aggregate.compression import ZSTD_MAGIC, encode
from fedq.blobs import BlobStore, update_key
from fedq.coordinator.intake import task_id
from fedq.engine.app import app
from fedq.engine.names import FINALIZE_ROUND_TASK
from fedq.weights import dumps, loads

__all__ = ["app", "ATTACKS"]

Attack = Callable[[dict[str, Any], dict[str, Any], BlobStore], dict[str, Any]]
_honest = update.run_training


def _delta(result: dict[str, Any], store: BlobStore) -> dict[str, torch.Tensor]:
    return loads(store._read(result["key"]))


def _upload(result: dict[str, Any], store: BlobStore, data: bytes) -> dict[str, Any]:
    """Put ``data`` at the task's own key and name its true sha256 (a worker that
    means it, not a corrupted blob)."""
    ref = store.put(result["key"], data)
    return {**result, "sha256": ref.sha256, "bytes_up": ref.size}


def int8_chunk0(task: dict, result: dict, store: BlobStore) -> dict:
    stored, meta = encode(_delta(result, store), "int8", 256)
    return _upload(result, store, dumps(stored, {**meta, "fedq.chunk": "0"}))


def int8_length(task: dict, result: dict, store: BlobStore) -> dict:
    stored, meta = encode(_delta(result, store), "int8", 256)
    name = next(k for k in stored if k.endswith(".__q"))
    stored[name] = stored[name][:-1].clone()  # one value short
    return _upload(result, store, dumps(stored, meta))


def zstd_garbage(task: dict, result: dict, store: BlobStore) -> dict:
    return _upload(result, store, ZSTD_MAGIC + bytes(range(256)) * 64)


def zstd_bomb(task: dict, result: dict, store: BlobStore) -> dict:
    """A ~64 KiB frame that decompresses to 2 GiB of zeros."""
    import zstandard

    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, closefd=False) as writer:
        zeros = bytes(64 << 20)
        for _ in range(32):
            writer.write(zeros)
    return _upload(result, store, out.getvalue())


def oversize(task: dict, result: dict, store: BlobStore) -> dict:
    data = store._read(result["key"])
    return _upload(result, store, bytes(data) + bytes(32 << 20))  # 32 MiB of padding


def nan(task: dict, result: dict, store: BlobStore) -> dict:
    delta = _delta(result, store)
    first = next(k for k, v in delta.items() if v.dtype.is_floating_point)
    delta[first].view(-1)[0] = float("nan")
    return _upload(result, store, dumps(delta))


def huge_norm(task: dict, result: dict, store: BlobStore) -> dict:
    delta = {k: v * 1e6 if v.dtype.is_floating_point else v
             for k, v in _delta(result, store).items()}
    return _upload(result, store, dumps(delta))


def samples(task: dict, result: dict, store: BlobStore) -> dict:
    return {**result, "samples": 1_000_000_000}


def other_client(task: dict, result: dict, store: BlobStore) -> dict:
    return {**result, "client": (result["client"] + 1) % task["spec"]["num_clients"]}


def finished_round(task: dict, result: dict, store: BlobStore) -> dict:
    return {**result, "round": result["round"] - 1}


def replay(task: dict, result: dict, store: BlobStore) -> dict:
    """Point at another client's update of the round before (round 2 on)."""
    if task["round"] < 2:
        return result
    for client in range(task["spec"]["num_clients"]):
        key = update_key(task["job"], task["round"] - 1, client, 1)
        if client == task["client"]:
            continue
        try:
            data = store._read(key)
        except Exception:  # that client did not train in the round before
            continue
        import fedq.digest as digests

        return {**result, "key": key, "sha256": digests.of(data), "bytes_up": len(data)}
    return result


def version(task: dict, result: dict, store: BlobStore) -> dict:
    return {**result, "format": 999, "version": "9.9.9"}


def malformed(task: dict, result: dict, store: BlobStore) -> dict:
    return {**result, "bytes_up": -1, "stats": {**result["stats"], "gpu_util": 1e9}}


def huge_result(task: dict, result: dict, store: BlobStore) -> dict:
    """A result of 16 MiB in the result backend (its error text padded)."""
    return {**result, "error": "x" * (16 << 20)}


def never_sent(task: dict, result: dict, store: BlobStore) -> dict:
    """Plant results for tasks never sent (attempt 2 of every client of the round) and
    ring finalize's doorbell with a made-up result for another client; the worker's
    own result stays honest."""
    forged = []
    for client in range(task["spec"]["num_clients"]):
        fake = {**result, "client": client, "attempt": 2,
                "key": update_key(task["job"], task["round"], client, 2)}
        app.backend.store_result(task_id(task["job"], task["round"], 2, client, task["gen"]),
                                 fake, "SUCCESS")
        forged.append({**fake, "attempt": 1, "worker": "forged"})
    app.send_task(FINALIZE_ROUND_TASK, args=(forged, task["job"], task["round"]),
                  queue="control")
    return result


#: Stored states Celery's ``decode_result`` raises on, one a round (``undecodable``):
#: not JSON, a list, no status, nested past the recursion limit, a kombu marker that
#: does not parse, an exception state naming a class Celery refuses to rebuild.
UNDECODABLE = (
    b"\x00not json{",
    b"[1, 2]",
    b'{"result": 1}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"status": "SUCCESS", "result": {"__type__": "datetime", "__value__": "no date"}}',
    b'{"status": "FAILURE", "result": {"exc_type": "system", "exc_module": "os", '
    b'"exc_message": ["id"]}}',
)
#: task id -> the bytes its final state is replaced with (:func:`_poisoned`)
_POISON: dict[str, bytes] = {}


def undecodable(task: dict, result: dict, store: BlobStore) -> dict:
    """Its own task's final state replaced, as stored, by one of :data:`UNDECODABLE`
    (the round's)."""
    from celery import current_task

    _POISON[current_task.request.id] = UNDECODABLE[(task["round"] - 1) % len(UNDECODABLE)]
    return result


def _poisoned(key: Any, value: Any) -> Any:
    """``value``, or the poison of the task whose state key ``key`` is (its final
    SUCCESS only: its claim and heartbeats stay honest)."""
    name = key.decode() if isinstance(key, bytes) else str(key)
    tid = name.removeprefix("celery-task-meta-")
    text = value.decode() if isinstance(value, bytes) else str(value)
    if tid in _POISON and '"SUCCESS"' in text:
        return _POISON.pop(tid)
    return value


def _patch_backends() -> None:
    from celery.backends.filesystem import FilesystemBackend

    from fedq.engine.backend import RedisBackend

    store, put = RedisBackend._store, FilesystemBackend.set

    def redis_store(self: Any, key: Any, value: Any, *args: Any) -> Any:
        return store(self, key, _poisoned(key, value), *args)

    def file_set(self: Any, key: Any, value: Any) -> Any:
        return put(self, key, _poisoned(key, value))

    RedisBackend._store = redis_store  # type: ignore[method-assign]
    FilesystemBackend.set = file_set  # type: ignore[method-assign]


_patch_backends()


ATTACKS: dict[str, Attack] = {f.__name__: f for f in (
    int8_chunk0, int8_length, zstd_garbage, zstd_bomb, oversize, nan, huge_norm, samples,
    other_client, finished_round, replay, version, malformed, huge_result, never_sent,
    undecodable)}


def run_training(data: dict, store: BlobStore, worker: str,
                 revoked: Callable[[], str | None] | None = None) -> dict:
    result = _honest(data, store, worker, revoked)
    name = str((data.get("spec") or {}).get("name", ""))
    attack = ATTACKS.get(name.removeprefix("attack-"))
    if attack is None or result.get("status") != "ok":
        return result
    return attack(data, result, store)


update.run_training = run_training
