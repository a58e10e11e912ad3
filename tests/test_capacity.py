"""A model too large for the blob store, the store's server or the control worker is
refused at submit in one line with its numbers, before anything is written
(fedq/coordinator/capacity.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from fedq.coordinator import capacity
from fedq.spec import parse_spec
from fedq.testing.cluster import base_env
from fedq.testing.procs import run_module
from tests.conftest import private_redis

SPEC = {"name": "big", "model": "gpt", "model_args": {"n_layer": 1, "n_head": 2, "n_embd": 64},
        "dataset": "shakespeare", "dataset_args": {"block_size": 32, "max_works": 1},
        "num_clients": 2, "clients_per_round": 2, "rounds": 2, "local_steps": 1}


def _submit(tmp_path: Path, env: dict[str, str], **fields: Any) -> Any:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({**SPEC, **fields}))
    return run_module("fedq.cli", ["submit", str(spec)], env, 120)


def _refused(proc: Any, *words: str) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr
    return lines[0]


def _no_job(env: dict[str, str], blob_url: str) -> None:
    status = run_module("fedq.cli", ["status"], env, 120)
    assert status.returncode == 0 and "big" not in status.stdout, status.stdout
    assert redis.Redis.from_url(blob_url).keys("fedq:blob:jobs/*") == []


def test_a_model_larger_than_the_store_keeps_is_refused_at_submit(
        tmp_path: Path, redis_db: str) -> None:
    env = base_env(tmp_path / "home", FEDQ_BLOB_URL=redis_db)
    env["FEDQ_BLOB_CHUNK_MB"] = "0.00001"  # 10-byte chunks: at most 100,000 bytes a blob
    line = _refused(_submit(tmp_path, env), "as a blob and blob store", "keeps at most 0.095 MB",
                    "10,000 chunks", "FEDQ_BLOB_CHUNK_MB")
    assert redis_db.split("@")[-1].split("/")[0] in line
    _no_job(env, redis_db)
    env["FEDQ_BLOB_CHUNK_MB"] = "1"  # the same job fits 1 MiB chunks
    proc = _submit(tmp_path, env)
    assert proc.returncode == 0, proc.stderr


def test_a_job_that_would_fill_redis_maxmemory_is_refused_at_submit(tmp_path: Path) -> None:
    with private_redis() as (url, _):
        server = redis.Redis.from_url(url)
        used = int(server.info("memory")["used_memory"])
        server.config_set("maxmemory", used + (2 << 20))  # 2 MiB of room
        env = base_env(tmp_path / "home", FEDQ_BLOB_URL=url)
        line = _refused(_submit(tmp_path, env, rounds=20), "the job keeps up to",
                        "21 global models", "below its maxmemory", "MiB free")
        assert "fewer rounds" in line
        _no_job(env, url)
        shown = run_module("fedq.cli", ["doctor", "--services"], env, 120)
        assert "MiB free below its maxmemory of" in shown.stdout, shown.stdout + shown.stderr
        assert _submit(tmp_path, env, rounds=1).returncode == 0  # 2 globals, 2 updates fit


@pytest.mark.parametrize(("server", "state"), [("fedavg", 0), ("fedavgm", 1), ("diloco", 1),
                                                ("fedadam", 2), ("fedyogi", 2)])
def test_the_control_worker_is_asked_for_the_copies_its_server_optimizer_keeps(
        tmp_path: Path, redis_db: str, server: str, state: int) -> None:
    spec = parse_spec({**SPEC, "server": {"name": server}})
    assert capacity.state_copies(spec) == state
    need = capacity.need(spec, 100 << 20)
    assert need.control == capacity.PROCESS_BYTES + (capacity.HELD_COPIES + state) * (100 << 20)
    # a store that keeps it as chunks: the lean commit holds the accumulator and chunks
    # and the server state one tensor at a time (the largest: 1M elements of float32)
    lean = capacity.need(spec, 100 << 20, 64 << 20, largest=1 << 20)
    assert lean.held == capacity.LEAN_COPIES == 1
    assert lean.state_bytes == state * (4 << 20)
    assert lean.control == capacity.PROCESS_BYTES + 3 * (64 << 20) + (100 << 20) \
        + state * (4 << 20)
    assert capacity.need(spec, 60 << 20, 64 << 20).held == capacity.HELD_COPIES  # one value
    clipped = parse_spec({**SPEC, "server": {"name": server}, "clip_norm": 1.0})
    assert capacity.need(clipped, 100 << 20, 64 << 20).held == capacity.LEAN_COPIES
    private = parse_spec({**SPEC, "server": {"name": server},
                          "dp": {"noise_multiplier": 0.5, "clip_norm": 1.0}})
    assert capacity.need(private, 100 << 20, 64 << 20).held == capacity.HELD_COPIES
    assert need.store == (100 << 20) * (spec.rounds + 1 + spec.clients_per_round)
    if server not in ("fedavg", "diloco"):
        return
    env = base_env(tmp_path / "home", FEDQ_BLOB_URL=redis_db)
    env["FEDQ_CONTROL_MEMORY_MB"] = "500"  # below a control worker's own 768 MB
    line = _refused(_submit(tmp_path, env, server={"name": server}),
                    "aggregating needs about", "FEDQ_CONTROL_MEMORY_MB allows 500 MB",
                    f"{capacity.HELD_COPIES + state} copies of the")
    assert ("diloco's state" in line) == (server == "diloco"), line
    _no_job(env, redis_db)
    env["FEDQ_CONTROL_MEMORY_MB"] = "1000"
    assert _submit(tmp_path, env, server={"name": server}).returncode == 0


def test_a_buffered_job_is_counted_with_its_buffer() -> None:
    """A buffered job keeps the updates out and a version's buffer beside its globals."""
    spec = parse_spec({**SPEC, "aggregation": {"mode": "buffered", "buffer": 3}})
    need = capacity.need(spec, 10 << 20)
    assert need.store == (10 << 20) * (spec.rounds + 1 + spec.clients_per_round + 3)
