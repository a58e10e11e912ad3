"""Time-budgeted rounds with one of three workers slowed 4x: the round follows the
budget, the slow worker contributes fewer steps, and the aggregate weighs it by the
samples it processed. Workers register their hardware and throughput."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from fedq.aggregate import apply_delta, weighted_mean
from fedq.blobs import BlobRef, global_key, open_store
from fedq.db import ClientUpdate, Round, Worker, session_scope
from fedq.testing.cluster import DIGITS, Cluster, base_env
from fedq.weights import loads

BUDGET = 1.5
# lr 0.01: as many steps as 1.5 s allows at DIGITS' lr 0.05 with momentum 0.9 can
# diverge (SLOW_TASKS in tests/test_faults.py)
SPEC = {**DIGITS, "num_clients": 3, "clients_per_round": 3, "rounds": 2, "local_epochs": 100,
        "time_budget_s": BUDGET, "weight_by": "processed", "queues": {"cpu": 3},
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9}}


@pytest.mark.slow
def test_time_budget_with_a_slow_worker(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    cluster.start(fast1=["cpu"], fast2=["cpu"], control=["control"])
    cluster.add("slow", ["cpu"], FEDQ_TEST_SLOWDOWN="4")
    job, view = cluster.run(SPEC)
    assert view.status == "completed", view.error
    settings = cluster.settings
    store = open_store(settings.blob_url)
    with session_scope(settings.database_url) as s:
        rows = s.scalars(select(ClientUpdate).where(ClientUpdate.job_id == job)).all()
        rounds = {r.number: r for r in s.scalars(select(Round).where(Round.job_id == job))}
        workers = {w.hostname: w for w in s.scalars(select(Worker))}
    for number in (1, 2):
        batch = [r for r in rows if r.round_number == number]
        assert len(batch) == 3 and all(r.status == "ok" for r in batch)
        slow_rows = [r for r in batch if r.worker == "slow@test"]
        fast_rows = [r for r in batch if r.worker != "slow@test"]
        if slow_rows:  # the slow worker took a task this round
            # it trained for the budget too, and so managed far fewer steps: about 1/4
            # alone; exactly 1/2 was seen in CI, where the tests run beside others on 2
            # cores and the slow worker's sleeps leave the fast ones more of the CPU
            assert slow_rows[0].steps < 0.75 * min(r.steps for r in fast_rows)
        # every task stopped at the budget, not at its 100 epochs
        assert all(r.processed < 100 * r.samples for r in batch)
        if number == 2:  # warm workers (round 1 includes loading the data set and model)
            assert all(r.seconds < BUDGET + 2.0 for r in batch), [r.seconds for r in batch]
        # the committed model is the previous one plus the processed-weighted mean delta
        previous = loads(store._read(global_key(job, number - 1)))
        deltas = [(float(r.processed), loads(store.get(BlobRef(r.blob_key, r.blob_sha256,
                                                               r.bytes_up))))
                  for r in batch]
        expected = apply_delta(previous, weighted_mean(deltas))
        got = loads(store._read(global_key(job, number)))
        for name in expected:
            torch.testing.assert_close(got[name], expected[name])
        assert rounds[number].samples == sum(r.samples for r in batch)
    assert any(r.worker == "slow@test" for r in rows), "the slow worker took no task"
    # workers registered at start and carry measured throughput after the job
    assert {"fast1@test", "fast2@test", "slow@test", "control@test"} <= set(workers)
    assert workers["fast1@test"].hardware["hardware_class"] == "cpu"
    assert workers["fast1@test"].hardware["concurrency"] == 1  # -c 1: its pool's size
    assert workers["slow@test"].samples_per_second < workers["fast1@test"].samples_per_second


@pytest.mark.slow
def test_auto_queue_mix_follows_measured_throughput(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    cluster.start(gpu=["gpu_new"], control=["control"])
    cluster.add("cpu", ["cpu"], FEDQ_TEST_SLOWDOWN="6")
    spec = {**DIGITS, "num_clients": 10, "clients_per_round": 5, "rounds": 2,
            "local_epochs": None, "local_steps": 10, "queues": "auto"}
    job, view = cluster.run(spec)
    assert view.status == "completed", view.error
    with session_scope(cluster.settings.database_url) as s:
        planned = {r.number: r.planned["queues"]
                   for r in s.scalars(select(Round).where(Round.job_id == job))}
    # round 1: nothing measured, both live queues count alike (ties go to gpu_new first)
    assert sorted(planned[1]) == ["cpu", "cpu", "gpu_new", "gpu_new", "gpu_new"]
    # round 2: the cpu worker measured slower, so the gpu_new queue gets most of the 5
    # (ignoring the measurement would give 3). The measured ratio of 10-step tasks is
    # noisy (seen from 2.3x to over 9x here with a 4x or 8x slowdown), so 4 and 5 both pass.
    assert planned[2].count("gpu_new") >= 4, planned[2]
