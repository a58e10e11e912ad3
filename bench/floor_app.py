"""The bare Celery chord floor: fedq's design with nothing of fedq in it.

Each round is a chord of N ``floor.train`` tasks (each GETs the global blob from Redis
and SETs it back as its update, unchanged) whose callback ``floor.aggregate`` GETs the N
updates, averages them with numpy, SETs the new global blob, stamps the time and
sends the next round's chord. No hashing, no validation, no database, no safetensors:
what is left is Celery plus moving the bytes through Redis, the least any design
built this way can spend per round.

    celery -A bench.floor_app worker -Q floor_train    # FLOOR_REDIS_URL=redis://...
"""

from __future__ import annotations

import os
import time
from functools import lru_cache
from typing import Any

import numpy as np
import redis
from celery import Celery, chord

URL = os.environ.get("FLOOR_REDIS_URL", "redis://127.0.0.1:6379/13")
app = Celery("floor", broker=URL, backend=URL)
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                worker_prefetch_multiplier=1, task_acks_late=True,
                broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)


@lru_cache(maxsize=1)
def _redis() -> Any:
    return redis.Redis.from_url(URL)


@app.task(name="floor.train")
def train(round_number: int, client: int) -> str:
    r = _redis()
    data = r.get("floor:global")
    key = f"floor:update:{round_number}:{client}"
    r.set(key, data)
    return key


@app.task(name="floor.aggregate")
def aggregate(keys: list[str], round_number: int, rounds: int, clients: int) -> None:
    r = _redis()
    acc: np.ndarray | None = None
    for key in keys:
        update = np.frombuffer(r.get(key), dtype=np.float32)
        if acc is None:
            acc = update.copy()
        else:
            acc += update
    assert acc is not None
    acc /= len(keys)
    r.set("floor:global", acc.tobytes())
    r.delete(*keys)
    r.rpush("floor:times", repr(time.time()))
    if round_number < rounds:
        start(round_number + 1, rounds, clients)


def start(round_number: int, rounds: int, clients: int) -> None:
    header = [train.s(round_number, c).set(queue="floor_train") for c in range(clients)]
    chord(header)(aggregate.s(round_number, rounds, clients).set(queue="floor_control"))


def run_floor(work: Any, redis_url: str, nbytes: int, rounds: int, clients: int,
              timeout: float = 600) -> list[float]:
    """Start the floor's workers, run ``rounds`` rounds of ``nbytes`` blobs, and return
    the seconds between consecutive rounds' callbacks (the first round not counted)."""
    from pathlib import Path

    from fedq.testing.procs import WorkerProcess, start_workers, stop_workers

    env = {"FLOOR_REDIS_URL": redis_url, "PYTHONPATH": str(Path(__file__).parents[1])}
    logs = Path(work) / f"floor-{time.monotonic_ns()}"
    workers = [WorkerProcess(f"floor{i}@bench", ["floor_train"], logs / f"w{i}.log", env=env,
                             app="bench.floor_app") for i in range(clients)]
    workers.append(WorkerProcess("floorctl@bench", ["floor_control"], logs / "control.log",
                                 env=env, app="bench.floor_app"))
    r = redis.Redis.from_url(redis_url)
    r.delete("floor:times")
    r.set("floor:global", np.zeros(nbytes // 4, dtype=np.float32).tobytes())
    start_workers(workers)
    try:
        client = Celery("floor-client", broker=redis_url, backend=redis_url,
                        set_as_current=False)
        client.conf.update(app.conf)
        client.conf.update(broker_url=redis_url, result_backend=redis_url)
        header = [client.signature("floor.train", args=(1, c), queue="floor_train")
                  for c in range(clients)]
        chord(header, app=client)(client.signature(
            "floor.aggregate", args=(1, rounds, clients), queue="floor_control"))
        deadline = time.monotonic() + timeout
        while r.llen("floor:times") < rounds:
            if time.monotonic() > deadline:
                raise TimeoutError(f"floor: {r.llen('floor:times')} of {rounds} rounds "
                                   f"after {timeout:.0f}s; see {logs}")
            time.sleep(0.05)
        times = [float(t) for t in r.lrange("floor:times", 0, -1)]
    finally:
        stop_workers(workers)
    return [b - a for a, b in zip(times, times[1:])]
