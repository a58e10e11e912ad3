"""A worker over several devices of its machine (FEDQ_DEVICES; fedq/worker/ranks.py): on
this CPU, gloo ranks in processes of their own. The two-process client's update is the
one-process update of the same batches; a worker of two ranks and a worker of one
train one job; a rank killed mid-task fails its task at once and the job completes."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fedq.blobs import global_key, open_store
from fedq.coordinator.evaluation import initial_weights
from fedq.protocol.training import TrainRef, UpdateRef
from fedq.settings import get_settings
from fedq.spec import JobSpec
from fedq.status import UpdateStatus
from fedq.testing import hold
from fedq.testing.cluster import DIGITS, Cluster
from fedq.testing.wait import wait_until
from fedq.weights import dumps, loads
from fedq.worker import ranks
from fedq.worker.update import run_training

SPEC: dict[str, Any] = {**DIGITS, "name": "two-devices", "local_epochs": None,
                        "local_steps": 6, "batch_size": 16,
                        "optimizer": {"name": "adam", "lr": 0.01}}


def _update(store: Any, ref: TrainRef) -> tuple[UpdateRef, dict[str, torch.Tensor]]:
    out = UpdateRef.from_json(run_training(ref.to_json(), store, "w"))
    assert out.status == "ok", out.error
    assert out.key is not None and out.sha256 is not None
    from fedq.blobs import BlobRef

    return out, loads(store.get(BlobRef(out.key, out.sha256, out.bytes_up)))


def test_two_processes_send_the_update_one_process_sends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FEDQ_DEVICES=2 on this CPU: the task's process and one helper (gloo) each train
    on half of every batch, the gradients averaged; the update equals one process's on
    the whole batches within float error, with the same samples, steps and examples
    seen. Drop the ranks (train the slice alone) and the update is another."""
    spec = JobSpec.model_validate(SPEC)
    store = open_store(str(tmp_path / "blobs"))
    blob = store.put(global_key("j", 0), dumps(initial_weights(spec)))
    one, alone = _update(store, TrainRef("j", 1, 2, "cpu", spec.to_json(), blob, attempt=1))
    monkeypatch.setenv("FEDQ_DEVICES", "2")
    get_settings.cache_clear()
    try:
        two, together = _update(store, TrainRef("j", 1, 2, "cpu", spec.to_json(), blob,
                                                attempt=2))
    finally:
        get_settings.cache_clear()
    assert (two.samples, two.steps, two.stats.seen) == (one.samples, one.steps, one.stats.seen)
    assert one.loss is not None and two.loss is not None
    assert abs(two.loss - one.loss) < 1e-5 * max(1.0, abs(one.loss)), (two.loss, one.loss)
    assert set(together) == set(alone)
    worst = max(float((together[k] - alone[k]).abs().max()) for k in alone)
    size = max(float(alone[k].abs().max()) for k in alone)
    assert worst < 1e-5 * max(size, 1.0), (worst, size)


def test_each_rank_trains_on_its_own_slice_of_every_batch() -> None:
    """local_train's ``shard``: rank r of 2 takes examples r, r+2, ... of each batch, so
    one step of rank 0 alone, of rank 1 alone and of the whole batch are three models;
    a batch smaller than the ranks is refused in one line."""
    from fedq.data import load_dataset
    from fedq.models import build_model
    from fedq.weights import state_of
    from fedq.worker.loop import local_train

    spec = JobSpec.model_validate(SPEC)
    ds = load_dataset("digits")
    x, y = ds.x_train[:64], ds.y_train[:64]
    start = state_of(build_model("small_cnn", ds.input_shape, ds.num_classes))
    out = []
    for shard in (None, (0, 2), (1, 2)):
        model = build_model("small_cnn", ds.input_shape, ds.num_classes)
        model.load_state_dict(start)
        local_train(model, x, y, optimizer=spec.optimizer, batch_size=16, epochs=None,
                    steps=1, seed=3, device=torch.device("cpu"), shard=shard)
        out.append(state_of(model))
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert any(not torch.equal(out[a][k], out[b][k]) for k in start), (a, b)
    with pytest.raises(ValueError, match="batch_size 1 is less than the worker's 2 devices"):
        local_train(build_model("small_cnn", ds.input_shape, ds.num_classes), x, y,
                    optimizer=spec.optimizer, batch_size=1, epochs=None, steps=1, seed=3,
                    device=torch.device("cpu"), shard=(0, 2))


def test_devices_are_read_as_the_setting_says() -> None:
    """FEDQ_DEVICES: unset, 1, all, a count, indices; a GPU the machine lacks is one
    line."""
    cpu, gpu = torch.device("cpu"), lambda i: torch.device("cuda", i)
    assert ranks.devices(None, 0) == [cpu] and ranks.devices("all", 0) == [cpu]
    assert ranks.devices("3", 0) == [cpu] * 3
    assert ranks.devices("all", 4) == [gpu(i) for i in range(4)]
    assert ranks.devices("2", 4) == [gpu(0), gpu(1)] and ranks.devices("1,3", 4) == \
        [gpu(1), gpu(3)]
    for bad, said in (("5", "this machine has 4 GPU(s)"), ("0,4", "GPU 4 is not one"),
                      ("x", "all, a count, or GPU indices")):
        with pytest.raises(ValueError, match=re.escape(said)):
            ranks.devices(bad, 4)


@pytest.mark.slow
def test_a_killed_rank_fails_its_task_at_once_and_the_job_completes(
        redis_cluster: Cluster, tmp_path: Path) -> None:
    """Worker `island` trains each task over two processes (FEDQ_DEVICES=2), worker
    `one` over one; both take one job's clients. The island's first task is held with
    its ranks' group formed (FEDQ_TEST_HOLD at `rank`), its helper rank SIGKILLed
    there: rank 0's next collective fails, the task reports it within
    seconds (not the collective's 120 s timeout), the client is sent again and the job
    completes with every client's update once."""
    cluster = redis_cluster
    holds = hold.Holds(tmp_path / "holds")
    cluster.start(control=["control"], one=["cpu"])
    first = r"-r1-c\d+-a1-rank1$"  # the island's first task of round 1
    cluster.add("island", ["cpu"], FEDQ_DEVICES="2", **holds.env("rank", first))
    # every client's update needed (min_clients 4): the failed one is sent again
    job = cluster.submit({**SPEC, "name": "island", "rounds": 2, "clients_per_round": 4,
                          "min_clients": 4, "max_redispatch": 2})
    wait_until(lambda: holds.waiting(first), 180, what=cluster.by_name("island").tail)
    ((task, who),) = holds.waiting(first).items()
    client = int(re.search(r"-c(\d+)-a1-", task).group(1))  # type: ignore[union-attr]
    pid = int(who.removeprefix("pid "))
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    island = cluster.by_name("island")
    said = b"rank 1 of 2 killed by signal 9"
    wait_until(lambda: said in island.log_path.read_bytes(), 60, what=island.tail)
    took = time.monotonic() - killed
    assert took < 30, took
    done = cluster.wait(job, timeout=300)
    assert done.status == "completed", done.error
    rows = cluster.updates(job)
    ok = [u for u in rows if u.status == UpdateStatus.OK]
    assert len(ok) == 8 and len({(u.round_number, u.client) for u in ok}) == 8, \
        [(u.round_number, u.client, u.status, u.attempt, u.error) for u in rows]
    (again,) = [u for u in ok if (u.round_number, u.client) == (1, client)]
    assert again.attempt == 2, again.attempt  # sent again after the failed attempt
    assert {u.worker for u in ok} == {"one@test", "island@test"}, (
        [(u.round_number, u.client, u.worker, u.status, u.attempt, u.error) for u in rows],
        island.tail(60))
    assert b"training over 2 devices: cpu, cpu" in island.log_path.read_bytes()
    holds.close()
