"""Ray Serve and Ray Data on the same models, for bench/inference.py's comparison.

Runs in Ray's own environment (scripts/ray-env.sh: ray, torch, safetensors, numpy;
never a fedq dependency), with the repository on its path for ``fedq.models``,
``fedq.weights`` and ``fedq.data.text``, which need nothing more:

    RAY_PY app.py serve CONFIG.json   # Ray Serve, @serve.batch; prints "ready <port>",
                                      # serves until its stdin closes
    RAY_PY app.py data CONFIG.json    # Ray Data map_batches on an actor pool; prints
                                      # one JSON line of measurements

CONFIG (written by bench/inference.py) names the weights, the model and its shapes,
the batch policy and, for ``data``, the prompts and the generation's settings.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from fedq.data import text as text_data  # noqa: E402
from fedq.models import build_model  # noqa: E402
from fedq.weights import loads  # noqa: E402


def _model(cfg: dict[str, Any]) -> torch.nn.Module:
    torch.set_num_threads(1)  # as each fedq worker (FEDQ_TORCH_THREADS=1)
    model = build_model(cfg["model"], tuple(cfg["input_shape"]), cfg["num_classes"],
                        **cfg.get("model_args", {})).eval()
    model.load_state_dict(loads(Path(cfg["weights"]).read_bytes()))
    return model


#: Ray Serve's throughput-optimized mode (Ray 2.55.1's serve/_private/constants.py: user
#: code and the router on the replica's own loop, buffered request-path logs, no log to
#: stderr, gRPC between deployments, direct ingress), set for every Ray process.
THROUGHPUT = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


def _init(cfg: dict[str, Any]) -> None:
    """Ray on this machine's cores, its session files under ``temp_dir`` (read for Serve's
    warnings afterwards); its workers import fedq from the repository too, with the
    environment ``env``."""
    ray.init(num_cpus=cfg["cpus"], include_dashboard=False, log_to_driver=False,
             _temp_dir=cfg.get("temp_dir"),
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **cfg.get("env", {})}})


def serve_main(cfg: dict[str, Any]) -> None:
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(num_replicas=cfg["replicas"],
                      max_ongoing_requests=cfg["max_ongoing_requests"],
                      logging_config={"enable_access_log": False},
                      ray_actor_options={"num_cpus": cfg["replica_cpus"]})
    class Classifier:
        def __init__(self) -> None:
            self.model = _model(cfg)

        @serve.batch(max_batch_size=cfg["max_batch"],
                     batch_wait_timeout_s=cfg["max_wait_ms"] / 1000)
        async def predict(self, images: list[list[float]]) -> list[dict[str, Any]]:
            x = torch.tensor(images, dtype=torch.float32).reshape(-1, *cfg["input_shape"])
            with torch.no_grad():
                probs = torch.softmax(self.model(x), dim=-1)
            return [{"label": int(p.argmax()), "probs": p.tolist()} for p in probs]

        async def __call__(self, request: Request) -> dict[str, Any]:
            if request.method == "GET":  # what this replica runs with, as Serve holds it
                context = serve.get_replica_context()
                config = context._deployment_config
                return {"max_ongoing_requests": config.max_ongoing_requests,
                        "replicas": context.world_size,
                        "max_batch_size": cfg["max_batch"],
                        "batch_wait_timeout_s": cfg["max_wait_ms"] / 1000,
                        "throughput_optimized": os.environ.get(
                            "RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")}
            body = await request.json()
            return {"outputs": [await self.predict(body["inputs"][0])]}

    _init(cfg)
    serve.start(http_options={"host": "127.0.0.1", "port": cfg["port"]})
    serve.run(Classifier.bind(), route_prefix="/")  # type: ignore[attr-defined]
    print(f"ready {cfg['port']}", flush=True)
    sys.stdin.read()  # until the bench closes it
    serve.shutdown()
    ray.shutdown()


class Generator:
    """One actor of the pool: the GPT loaded once; the second actor to start is slowed
    (it sleeps ``slow - 1`` times its compute after each batch, as FEDQ_TEST_SLOWDOWN does)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.model = _model(cfg)
        self.slot = 0
        while True:  # which actor this is: the first free slot file
            try:
                os.close(os.open(Path(cfg["slots"]) / f"slot-{self.slot}",
                                 os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                self.slot += 1
        self.slowdown = cfg["slow"] if self.slot == 1 else 1.0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.time()
        # the batch's prompts generated together, as a fedq worker does (GPT.generate_batch)
        rows = [text_data.prompt_ids(str(p)) for p in batch["prompt"]]
        gens = [torch.Generator().manual_seed(self.cfg["seed"] + int(i)) for i in batch["i"]]
        outs = self.model.generate_batch(  # type: ignore[operator]
            rows, self.cfg["max_tokens"], temperature=self.cfg["temperature"],
            top_k=self.cfg["top_k"] or None, generators=gens)
        texts = [text_data.decode(out) for out in outs]
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.time() - start))
        n = len(texts)
        return {"i": batch["i"], "text": np.array(texts, dtype=object),
                "actor": np.full(n, self.slot), "start": np.full(n, start),
                "end": np.full(n, time.time())}


def data_main(cfg: dict[str, Any]) -> None:
    """The batch job on Ray Data: the prompts in blocks of one batch each, an actor pool
    of ``actors`` with ``in_flight`` tasks at most per actor, progress bars off."""
    _init(cfg)
    ray.data.DataContext.get_current().enable_progress_bars = False
    prompts = [json.loads(line)["prompt"] for line in Path(cfg["prompts"]).read_text()
               .splitlines() if line.strip()]
    ds = ray.data.from_items([{"i": i, "prompt": p} for i, p in enumerate(prompts)],
                             override_num_blocks=-(-len(prompts) // cfg["batch_size"]))
    began = time.time()
    rows = ds.map_batches(Generator, fn_constructor_kwargs={"cfg": cfg},
                          batch_size=cfg["batch_size"],
                          compute=ray.data.ActorPoolStrategy(
                              size=cfg["actors"],
                              max_tasks_in_flight_per_actor=cfg.get("in_flight", 1)),
                          num_cpus=cfg["actor_cpus"]).take_all()
    ended = time.time()
    ray.shutdown()
    first, last = min(r["start"] for r in rows), max(r["end"] for r in rows)
    by_actor: dict[str, int] = {}
    for r in rows:
        by_actor[f"actor{int(r['actor'])}"] = by_actor.get(f"actor{int(r['actor'])}", 0) + 1
    print(json.dumps({"items": len(rows), "distinct": len({int(r["i"]) for r in rows}),
                      "wall_s": last - first, "items_per_s": len(rows) / (last - first),
                      "with_startup_s": ended - began, "by_worker": by_actor}), flush=True)


if __name__ == "__main__":
    mode, path = sys.argv[1], Path(sys.argv[2])
    {"serve": serve_main, "data": data_main}[mode](json.loads(path.read_text()))
