"""The served benchmark's batched HTTP floor: fedq serve's batch policy with no broker and
no worker.

    .venv/bin/python -m bench.http_batched WEIGHTS PORT [PROCESSES]

A Starlette app on uvicorn (the HTTP stack ``fedq serve`` runs: httptools on uvloop),
in PROCESSES processes (default 1) sharing the port, that answers ``POST /v1/predict``
from a batcher in its own process: requests are collected into batches of at most 32
the way fedq's gateway collects them (fedq/serve/batcher.py: a batch goes at once when
none is out, else it waits up to 5 ms for more) and each batch runs the small CNN on one
thread of the process (as a worker of ``-c 1`` runs one batch at a time). What is left
is HTTP, JSON and the model on batches: the most ``fedq serve`` could answer if its
broker and workers cost nothing.
"""

from __future__ import annotations

import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fedq.data import load_dataset
from fedq.models import build_model
from fedq.weights import loads

MAX_BATCH = 32  # the gateway's --max-batch in bench/inference.py
MAX_WAIT_S = 0.005  # its --max-wait-ms 5
WEIGHTS = "FEDQ_BENCH_WEIGHTS"


class Batcher:
    """fedq serve's batch policy in one process: the first waiting request starts a
    batch; with no batch out it goes at once with what is queued, else it waits up to
    :data:`MAX_WAIT_S` for more; batches run one at a time on one thread."""

    def __init__(self, model: torch.nn.Module, shape: tuple[int, ...]) -> None:
        self.model, self.shape = model, shape
        self.queue: asyncio.Queue[tuple[list[float], asyncio.Future[Any]]] = asyncio.Queue()
        self.out = 0
        self.pool = ThreadPoolExecutor(1)
        self.batches: list[int] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + (MAX_WAIT_S if self.out else 0.0)
            while len(batch) < MAX_BATCH:
                left = deadline - loop.time()
                if left <= 0:
                    while len(batch) < MAX_BATCH and not self.queue.empty():
                        batch.append(self.queue.get_nowait())
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            self.out += 1
            asyncio.create_task(self.dispatch(batch))

    def compute(self, images: list[list[float]]) -> list[dict[str, Any]]:
        x = torch.tensor(images, dtype=torch.float32).reshape(-1, *self.shape)
        with torch.no_grad():
            probs = torch.softmax(self.model(x), dim=-1)
        return [{"label": int(p.argmax()), "probs": p.tolist()} for p in probs]

    async def dispatch(self, batch: list[tuple[list[float], asyncio.Future[Any]]]) -> None:
        try:
            self.batches = (self.batches + [len(batch)])[-1000:]
            outs = await asyncio.get_running_loop().run_in_executor(
                self.pool, self.compute, [image for image, _ in batch])
            for (_, future), out in zip(batch, outs):
                future.set_result(out)
        finally:
            self.out -= 1


def make_app() -> Starlette:
    """The app, its model read from the file ``FEDQ_BENCH_WEIGHTS`` names (uvicorn's
    factory: each process builds its own)."""
    torch.set_num_threads(1)
    ds = load_dataset("digits")
    model = build_model("small_cnn", ds.input_shape, ds.num_classes).eval()
    model.load_state_dict(loads(Path(os.environ[WEIGHTS]).read_bytes()))
    batcher = Batcher(model, tuple(ds.input_shape))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    async def predict(request: Request) -> JSONResponse:
        body: Any = await request.json()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        batcher.queue.put_nowait((body["inputs"][0], future))
        return JSONResponse({"outputs": [await future]})

    async def health(request: Request) -> JSONResponse:
        sizes = batcher.batches or [0]
        return JSONResponse({"status": "ok", "mean_batch": sum(sizes) / len(sizes)})

    return Starlette(routes=[Route("/v1/predict", predict, methods=["POST"]),
                             Route("/health", health)], lifespan=lifespan)


if __name__ == "__main__":
    import uvicorn

    from fedq.serve.app import http_stack

    os.environ[WEIGHTS] = str(Path(sys.argv[1]).absolute())
    processes = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    http, loop = http_stack()  # the gateway's own HTTP stack
    uvicorn.run("bench.http_batched:make_app", factory=True, host="127.0.0.1",
                port=int(sys.argv[2]), workers=processes, log_level="warning", http=http,
                loop=loop)
