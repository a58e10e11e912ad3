"""Benchmark 1: round overhead with zero training compute.

4 clients per round, every client in every round; each client returns the global
weights plus a small change. Compared, in the same run, on a tiny model and on a
ResNet-18-size model (the same tensor shapes everywhere):

- fedq on Redis (broker, result backend, blob store) and PostgreSQL, with one control
  worker and 4 training workers (``celery -A fedq worker``, one process each);
- the bare Celery chord floor (bench/floor_app.py), same worker layout;
- Flower's Deployment Engine and Simulation Engine (bench/flower_run.py).
"""

from __future__ import annotations

from bench.common import BenchError, Context, Section, Stat, fmt_ratio, redis_database
from bench.fedq_run import fedq_cluster, run_job, zero_compute_spec

CLIENTS = 4


def model_shapes(model: str) -> tuple[list[list[int]], int]:
    """Tensor shapes and bytes of fedq's model for a zero-compute spec."""
    from fedq.data import load_dataset
    from fedq.models import build_model
    from fedq.spec import JobSpec

    spec = JobSpec.stored(zero_compute_spec(model, 1, CLIENTS))
    ds = load_dataset(spec.dataset, spec.data_dir, spec.dataset_args)
    state = build_model(spec.model, ds.input_shape, ds.num_classes, **spec.model_args) \
        .state_dict()
    return ([list(v.shape) for v in state.values()],
            sum(v.numel() * 4 for v in state.values()))  # float32 on the wire


def run(ctx: Context) -> Section:
    rounds = 4 if ctx.smoke else 11  # the first round is not timed: 10 intervals
    models = ["tiny"] if ctx.smoke else ["tiny", "resnet18"]
    engines = ["simulation"] if ctx.smoke else ["deployment", "simulation"]
    sec = Section(
        "1. Round overhead (zero training compute)",
        f"{CLIENTS} clients, all in every round; each returns the global weights plus a "
        f"small change. Seconds per round: median over {rounds - 1} consecutive rounds "
        "(the first, which includes loading, is not counted), min–max in brackets. "
        "fedq: Redis broker/result backend/blob store + PostgreSQL, a control worker and "
        f"{CLIENTS} training workers (one process each), zero compute (`FEDQ_TEST_ZERO_COMPUTE`), "
        "`eval_every: 0`, `keep_updates: 0`. Floor: a bare Celery chord on the same Redis "
        "moving the same bytes (bench/floor_app.py: tasks GET the global blob and SET it "
        "back; the callback GETs the updates, averages them with numpy, SETs the global "
        "blob and sends the next chord; redis-py as installed, no hiredis). Flower 1.42: "
        "bench/flower_app with Flower's FedAvg, its Deployment Engine (SuperLink + "
        f"{CLIENTS} SuperNodes on loopback) and Simulation Engine (`flower-superlink "
        "--simulation`), started by `flwr run`.",
        ["model", "size", "fedq s/round", "bare chord floor", "Flower deployment",
         "Flower simulation", "fedq ÷ floor", "Flower deployment ÷ fedq"])
    for model in models:
        shapes, nbytes = model_shapes(model)
        ctx.say(f"overhead/{model}: fedq ({nbytes / 1e6:.1f} MB, {rounds} rounds)")
        with fedq_cluster(ctx, f"overhead-{model}", CLIENTS) as cluster:
            fedq = Stat.of(run_job(cluster, zero_compute_spec(model, rounds, CLIENTS))
                           .intervals())
        ctx.say(f"overhead/{model}: fedq {fedq.fmt()} s/round; bare chord floor")
        floor = Stat.of(_floor(ctx, nbytes, rounds))
        ctx.say(f"overhead/{model}: floor {floor.fmt()} s/round")
        flower: dict[str, Stat | None] = {"deployment": None, "simulation": None}
        if ctx.flower_python is None:
            raise BenchError("the Flower environment is missing (scripts/bench.sh builds it)")
        for engine in engines:
            ctx.say(f"overhead/{model}: Flower {engine}")
            from bench.flower_run import flower_rounds

            flower[engine] = Stat.of(flower_rounds(ctx.flower_python.parent, ctx.work, engine,
                                                   shapes, rounds, CLIENTS))
            ctx.say(f"overhead/{model}: Flower {engine} {flower[engine].fmt()} s/round")  # type: ignore[union-attr]
        dep, sim = flower["deployment"], flower["simulation"]
        sec.rows.append([
            "tiny (mlp, digits)" if model == "tiny" else "ResNet-18 (CIFAR shape)",
            f"{nbytes / 1e6:.2f} MB" if nbytes > 1e6 else f"{nbytes / 1e3:.0f} kB",
            fedq.fmt(), floor.fmt(), dep.fmt() if dep else "not run (smoke)",
            sim.fmt() if sim else "—", fmt_ratio(fedq.median / floor.median),
            fmt_ratio(dep.median / fedq.median) if dep else "—"])
        if model == "tiny":
            sec.target("tiny model ≤ 0.05 s/round", fedq.median <= 0.05,
                       f"{fedq.median:.3f} s/round")
            sec.target("tiny round ≤ 1.5× the bare-chord floor (issue 33)",
                       fedq.median <= 1.5 * floor.median,
                       f"{fedq.median / floor.median:.2f}× ({fedq.median:.3f} vs "
                       f"{floor.median:.3f} s/round)")
        else:
            sec.target("ResNet-18 size within 1.3× of the bare-chord floor",
                       fedq.median <= 1.3 * floor.median,
                       f"{fedq.median / floor.median:.2f}× ({fedq.median:.3f} vs "
                       f"{floor.median:.3f} s/round)")
            if sim is not None:
                sec.target("ResNet-18 size ≤ 0.5× Flower's Simulation Engine round "
                           "(issue 33)", fedq.median <= 0.5 * sim.median,
                           f"{fedq.median / sim.median:.2f}× ({fedq.median:.3f} vs "
                           f"{sim.median:.3f} s/round)")
            if dep is not None:
                sec.target("ResNet-18 size ≥ 10× faster than Flower's Deployment Engine",
                           dep.median >= 10 * fedq.median,
                           f"{dep.median / fedq.median:.1f}× ({dep.median:.2f} vs "
                           f"{fedq.median:.3f} s/round)")
    return sec


def _floor(ctx: Context, nbytes: int, rounds: int) -> list[float]:
    import os

    with redis_database() as url:
        os.environ["FLOOR_REDIS_URL"] = url  # read when bench.floor_app is imported
        from bench.floor_app import run_floor

        return run_floor(ctx.work, url, nbytes, rounds, CLIENTS)
