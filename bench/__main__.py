"""Run the benchmark suite and write docs/benchmarks.md.

    bash scripts/bench.sh              # everything, 10-15 minutes on 2 cores
    bash scripts/bench.sh --smoke      # tiny sizes, a few minutes: CI runs this
    bash scripts/bench.sh --only aggregation,scale --out /tmp/b.md
    bash scripts/bench.sh --only overhead     # update that section of docs/benchmarks.md

scripts/bench.sh builds fedq's environment and Flower's (its own, never a fedq
dependency) and calls ``python -m bench --flower-python FLOWER_ENV/bin/python``.
The document is written only when every selected benchmark ran; a failure prints one
line naming it and exits 1. With ``--only``, an existing document keeps the other
sections and gains an ``updated:`` line naming the run that made the new ones.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import aggregation, jobs, overhead, phases
from bench.common import ROOT, BenchError, Context, commit, machine, versions

#: Below this line docs/benchmarks.md is written by hand and kept across runs.
MARKER = "<!-- end of generated part -->"

BENCHMARKS = {
    "overhead": overhead.run,
    "aggregation": aggregation.run,
    "codecs": jobs.compression,
    "hetero": jobs.heterogeneous,
    "scale": jobs.scale,
    "buffered": jobs.buffered,
    "buffered_lm": jobs.buffered_lm,
    "phases": phases.run,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash scripts/bench.sh",
                                     description="fedq benchmarks -> docs/benchmarks.md")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--flower-python", type=Path,
                        default=os.environ.get("FEDQ_BENCH_FLOWER_PYTHON") or None,
                        help="python of the Flower environment (scripts/bench.sh sets it)")
    args = parser.parse_args(argv)
    chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BENCHMARKS]
    if unknown:
        parser.error(f"--only: unknown benchmark {unknown[0]!r} "
                     f"(known: {', '.join(BENCHMARKS)})")
    if args.flower_python is not None and not Path(args.flower_python).exists():
        parser.error(f"--flower-python: {args.flower_python} does not exist")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedq-bench-") as work:
        ctx = Context(smoke=args.smoke, work=Path(work), flower_python=args.flower_python)
        sections = []
        with ctx.stack:
            for name in chosen:
                ctx.say(f"{name}: start")
                t0 = time.monotonic()
                try:
                    sections.append(BENCHMARKS[name](ctx))
                except BenchError as exc:
                    print(f"bench: {name}: {exc}", file=sys.stderr)
                    return 1
                ctx.say(f"{name}: done in {time.monotonic() - t0:.0f} s")
    command = "bash scripts/bench.sh" + "".join(
        f" {shlex.quote(a)}" for a in (argv if argv is not None else sys.argv[1:])
        if not a.startswith("--flower-python"))
    old = args.out.read_text() if args.out.exists() else ""
    partial = set(chosen) != set(BENCHMARKS) and not args.smoke and MARKER in old \
        and not old.startswith("# Benchmarks (smoke")
    if partial:  # --only: replace those sections, keep the others from their run
        text = _update(old.split(MARKER, 1)[0], sections, command, time.monotonic() - started)
    else:
        text = _document(sections, command, time.monotonic() - started, args)
    if MARKER in old:  # keep the hand-written part
        text += "\n" + MARKER + old.split(MARKER, 1)[1]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


_ONE_RUN = "every figure in this file comes from that one run"
_UPDATED = ("every figure in this file comes from that run, except the sections an "
            "`updated:` line names, which come from that later run")


def _update(generated: str, sections: list, command: str, seconds: float) -> str:
    """``generated`` (the generated part of docs/benchmarks.md) with the sections of the
    same titles replaced by ``sections`` and an ``updated:`` line saying which run made
    them."""
    parts = re.split(r"(?m)^(?=## )", generated)
    head, old = parts[0], parts[1:]
    new = {sec.title: sec.markdown() for sec in sections}
    titles = ", ".join(f"“{t}”" for t in new)
    body = [new.pop(p.splitlines()[0][3:].strip(), p) for p in old] + list(new.values())
    line = (f"- updated: {titles} by `{command}` ({seconds / 60:.1f} min) on "
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC at fedq commit {commit()}")
    # an earlier updated: line that names only sections this run remade is stale
    head = "".join(
        kept for kept in head.splitlines(keepends=True)
        if not (kept.startswith("- updated: ") and set(re.findall(r"“([^”]*)”", kept))
                <= {sec.title for sec in sections}))
    head = head.replace(_ONE_RUN, _UPDATED).rstrip("\n") + "\n" + line + "\n\n"
    return head + "\n".join(b.rstrip("\n") + "\n" for b in body)


def _document(sections: list, command: str, seconds: float, args: argparse.Namespace) -> str:
    vers = versions(args.flower_python)
    lines = [
        "# Benchmarks" + (" (smoke run: tiny sizes, not the real figures)" if args.smoke else ""),
        "",
        f"Generated by the command below; {_ONE_RUN}. Figures are medians over repeats "
        "with the min–max in brackets; ratios compare figures from the same run. Rerun it "
        "to check them on your machine.",
        "",
        f"- command: `{command}` (took {seconds / 60:.1f} min)",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- code: fedq commit {commit()}",
        f"- machine: {machine()}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
        "- services: Redis, PostgreSQL on 127.0.0.1 (the same machine)",
        "",
    ]
    for sec in sections:
        lines.append(sec.markdown(smoke=args.smoke))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
