"""What one HTTP request costs here with no fedq in it: the served benchmark's ceiling.

    .venv/bin/python -m bench.http_floor WEIGHTS PORT

A Starlette app on uvicorn (the stack ``fedq serve`` uses), one process, that answers
``POST /v1/predict`` by running the small CNN on the request's image in its own process:
no batching, no broker, no worker. bench/inference.py calls it at the same
concurrencies as ``fedq serve``; whatever a request costs here (HTTP, JSON, one model
call) every HTTP front pays, so it bounds requests/s for one image per request.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fedq.data import load_dataset
from fedq.models import build_model
from fedq.weights import loads


def app_for(weights: Path) -> Starlette:
    torch.set_num_threads(1)
    ds = load_dataset("digits")
    model = build_model("small_cnn", ds.input_shape, ds.num_classes).eval()
    model.load_state_dict(loads(weights.read_bytes()))

    async def predict(request: Request) -> JSONResponse:
        body: Any = await request.json()
        x = torch.tensor(body["inputs"], dtype=torch.float32).reshape(-1, *ds.input_shape)
        with torch.no_grad():
            probs = torch.softmax(model(x), dim=-1)
        return JSONResponse({"outputs": [{"label": int(p.argmax()), "probs": p.tolist()}
                                         for p in probs]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/predict", predict, methods=["POST"]),
                             Route("/health", health)])


if __name__ == "__main__":
    from fedq.serve.app import http_stack

    http, loop = http_stack()  # the gateway's own HTTP stack
    uvicorn.run(app_for(Path(sys.argv[1])), host="127.0.0.1", port=int(sys.argv[2]),
                log_level="warning", http=http, loop=loop)
