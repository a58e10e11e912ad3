"""The compressed downlink (``compression: {downlink: int8}``): the coordinator publishes
each new global model as an int8 step from the previous one, workers that hold the
previous model download the step instead of the model, and the model they rebuild is
bit-for-bit the one the coordinator stored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from fedq.aggregate.compression import Q_SUFFIX
from fedq.aggregate.downlink import apply_step, compress_step, content_digest
from fedq.blobs import global_key, open_store, step_key
from fedq.db import ClientUpdate, Job, Round, session_scope
from fedq.errors import BlobError, UpdateRejected
from fedq.process import PROCESS
from fedq.protocol.training import StepRef
from fedq.testing.cluster import DIGITS, Cluster, base_env
from fedq.weights import dumps, loads, loads_with_meta
from fedq.worker.update import fetch_global


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 300, generator=g), "b": torch.randn(7, generator=g),
            "count": torch.tensor(5, dtype=torch.int64)}


def test_a_step_rebuilds_the_published_model_exactly() -> None:
    previous, new = _model(0), _model(1)
    new["count"] = torch.tensor(6, dtype=torch.int64)
    published, residual, stored, meta = compress_step(previous, new, {}, chunk=64)
    assert stored["w" + Q_SUFFIX].dtype == torch.int8  # float tensors travel as int8
    assert torch.equal(stored["count"], new["count"])  # the rest travels whole
    # the published model is close to the optimizer's and the residual is the gap
    torch.testing.assert_close(published["w"] + residual["w"], new["w"])
    assert 0 < (published["w"] - new["w"]).abs().max() < 0.05
    # a worker rebuilds it bit for bit, through a safetensors file as it travels
    data = bytearray(dumps(stored, meta))
    tensors, read_meta = loads_with_meta(data)
    rebuilt = apply_step(previous, tensors, read_meta)
    assert content_digest(rebuilt) == content_digest(published) == meta["fedq.content"]
    assert all(torch.equal(rebuilt[k], published[k]) for k in published)


def test_a_step_written_before_blake3_is_checked_with_sha256() -> None:
    """A step's content digest is BLAKE3 now (fedq/digest.py); one a coordinator of
    message format 3 wrote (SHA-256, 64 hex digits) is checked with SHA-256, so a
    resumed job's last step still applies, and a wrong one is still refused."""
    previous, new = _model(0), _model(1)
    published, _, stored, meta = compress_step(previous, new, {}, chunk=64)
    assert meta["fedq.content"].startswith("b3-")
    old = {**meta, "fedq.content": content_digest(published, like="0" * 64)}
    assert len(old["fedq.content"]) == 64 and old["fedq.content"] != meta["fedq.content"]
    rebuilt = apply_step(previous, stored, old)
    assert all(torch.equal(rebuilt[k], published[k]) for k in published)
    with pytest.raises(UpdateRejected, match="content hash"):
        apply_step(previous, stored, {**old, "fedq.content": "f" * 64})


def test_a_step_that_does_not_rebuild_its_model_is_refused() -> None:
    previous, new = _model(0), _model(1)
    _, _, stored, meta = compress_step(previous, new, {}, chunk=64)
    other = {**previous, "w": previous["w"] + 1e-6}  # not the model the step is from
    with pytest.raises(UpdateRejected, match="content hash"):
        apply_step(other, stored, meta)
    with pytest.raises(UpdateRejected, match="no previous tensor"):
        apply_step({"b": previous["b"]}, stored, meta)
    with pytest.raises(UpdateRejected, match="not a model step"):
        apply_step(previous, stored, {**meta, "fedq.codec": "int8"})


def test_error_feedback_keeps_the_published_model_on_the_optimizers_path() -> None:
    """Twenty rounds of small steps: with the residual carried, the published model ends
    within one quantization step of where the optimizer's steps lead; without it, the
    rounding errors add up."""
    g = torch.Generator().manual_seed(3)
    start = {"w": torch.randn(4096, generator=g)}
    steps = [{"w": 1e-3 * torch.randn(4096, generator=g)} for _ in range(20)]
    target = start["w"] + sum(s["w"] for s in steps)
    ends = {}
    for carry in (True, False):
        published, residual = start, {}
        for s in steps:
            new = {"w": published["w"] + s["w"]}
            published, left, _, _ = compress_step(published, new, residual, chunk=256)
            residual = left if carry else {}
        ends[carry] = (published["w"] - target).abs().max().item()
    assert ends[True] < 2e-5 < ends[False], ends


def test_a_worker_falls_back_to_the_full_model(tmp_path: Path) -> None:
    """A step whose rebuilt model does not match its content hash (here: written for
    another base) costs a full download, never a wrong model."""
    store = open_store(f"file://{tmp_path}/blobs")
    previous, new = _model(0), _model(1)
    published, _, stored, meta = compress_step(previous, new, {}, chunk=64)
    base = store.put(global_key("j", 1), dumps(previous))
    full = store.put(global_key("j", 2), dumps(published))
    good = StepRef(store.put(step_key("j", 2), dumps(stored, meta)), base.sha256)
    _, _, wrong, wrong_meta = compress_step({**previous, "b": previous["b"] * 2}, new, {}, 64)
    bad = StepRef(store.put(step_key("j", 3), dumps(wrong, wrong_meta)), base.sha256)
    PROCESS.clear()
    try:
        PROCESS.keep_model(base.sha256, previous)
        got, down = fetch_global(store, full, bad)
        assert down == full.size and all(torch.equal(got[k], published[k]) for k in got)
        PROCESS.clear()
        PROCESS.keep_model(base.sha256, previous)
        got, down = fetch_global(store, full, good)
        assert down == good.blob.size < full.size
        assert all(torch.equal(got[k], published[k]) for k in published)
        PROCESS.clear()  # without the base: the full model
        assert fetch_global(store, full, good)[1] == full.size
    finally:
        PROCESS.clear()


@pytest.mark.slow
def test_workers_download_steps_and_train_on_the_stored_model(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    cluster.start(a=["cpu"], b=["cpu"], control=["control"])
    spec = {**DIGITS, "num_clients": 4, "clients_per_round": 2, "rounds": 4,
            "queues": {"cpu": 2}, "server": {"name": "diloco"},
            "compression": {"codec": "int8", "downlink": "int8"}}
    job, view = cluster.run(spec)
    assert view.status == "completed", view.error
    store = open_store(cluster.settings.blob_url)
    with session_scope(cluster.settings.database_url) as s:
        rows = s.scalars(select(ClientUpdate).where(ClientUpdate.job_id == job)).all()
        rounds = {r.number: r for r in s.scalars(select(Round).where(Round.job_id == job))}
        stored_job = s.get(Job, job)
        assert stored_job is not None
        last_step = (stored_job.step_key, stored_job.step_base)
    assert last_step == (step_key(job, 4), rounds[3].global_sha256)
    size = {n: len(store._read(global_key(job, n))) for n in range(5)}
    steps = {n: len(store._read(step_key(job, n))) for n in range(1, 5)}
    # every committed model is the previous one plus its step (the initial one has none)
    with pytest.raises(BlobError):
        store._read(step_key(job, 0))
    for n in range(1, 5):
        previous = loads(store._read(global_key(job, n - 1)))
        tensors, meta = loads_with_meta(store._read(step_key(job, n)))
        rebuilt = apply_step(previous, tensors, meta)
        assert content_digest(rebuilt) == content_digest(loads(store._read(global_key(job, n))))
        assert steps[n] < 0.3 * size[n]
    # round n trains on model n - 1: a worker that held model n - 2 downloads step n - 1
    by_round = {n: [r for r in rows if r.round_number == n] for n in range(1, 5)}
    assert all(r.bytes_down == 0 for r in by_round[1])  # round 0 rebuilt from the seed
    downs = [(n, r.bytes_down) for n in range(2, 5) for r in by_round[n]]
    assert all(b in (0, steps[n - 1], size[n - 1]) for n, b in downs), (downs, steps, size)
    assert sum(1 for n, b in downs if b == steps[n - 1]) >= 2, (downs, steps)
    assert rounds[4].bytes_down == sum(r.bytes_down for r in by_round[4])
    assert rounds[4].accuracy is not None and rounds[4].accuracy > 0.5


def test_round_zero_is_rebuilt_from_the_seed_not_downloaded(
        tmp_path: Path, worker_home: Path) -> None:
    from fedq.coordinator.evaluation import initial_weights
    from fedq.protocol.training import TrainRef, UpdateRef
    from fedq.spec import parse_spec
    from fedq.worker.update import run_training

    store = open_store(str(tmp_path / "blobs"))
    spec = parse_spec({**DIGITS, "num_clients": 2, "clients_per_round": 2, "rounds": 2,
                       "local_steps": 2})

    def first_round(job: str, seed: int) -> UpdateRef:
        PROCESS.clear()
        weights = initial_weights(spec.model_copy(update={"seed": seed}))
        blob = store.put(global_key(job, 0), dumps(weights, {"job": job}))
        out = UpdateRef.from_json(run_training(
            TrainRef(job, 1, 0, "cpu", spec.to_json(), blob).to_json(), store, "w"))
        assert out.status == "ok", out.error
        return out

    # the stored round-0 model is the one the spec's seed builds: nothing downloaded
    assert first_round("j1", spec.seed).bytes_down == 0
    # a round-0 model the seed does not build (here: another seed's) is downloaded
    other = first_round("j2", spec.seed + 1)
    assert other.bytes_down == len(store._read(global_key("j2", 0)))
