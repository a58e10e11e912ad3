"""Run the Byzantine and compression experiment on digits and write its table into
docs/strategies.md.

    .venv/bin/python -m bench.strategies            # about 2 minutes on 2 cores

The experiments are tests/test_strategy_jobs.py::test_byzantine_clients_and_int8_updates
(real jobs on the embedded default with three worker processes: 10 clients, all in
every round, 8 rounds, 3 local epochs, seed 7; the attackers are clients 0 and 1, whose
updates are sign-flipped and scaled x10) and tests/test_identity.py::
test_a_registered_hostile_machine_posing_as_three_clients_counts_as_one (Redis and
PostgreSQL, identity required: two honest registered machines and one hostile one
running three processes whose every update is sign-flipped x10; 5 of 10 clients a
round, the median). Each row is compared with its own test's clean run.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "strategies.md"
BEGIN, END = "<!-- begin generated table -->", "<!-- end generated table -->"
TESTS = ["tests/test_strategy_jobs.py::test_byzantine_clients_and_int8_updates",
         "tests/test_identity.py::"
         "test_a_registered_hostile_machine_posing_as_three_clients_counts_as_one"]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "rows.jsonl"
        env = {**os.environ, "FEDQ_TEST_REPORT": str(report), "CI": "true"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *TESTS], cwd=ROOT, env=env,
                              check=False)
        rows = [json.loads(line) for line in report.read_text().splitlines()] \
            if report.exists() else []
    rows = [r for r in rows if r.get("table") == "strategies"]
    if proc.returncode != 0 or not rows:
        print("bench.strategies: the experiment failed; docs/strategies.md not updated",
              file=sys.stderr)
        return proc.returncode or 1
    lines = [BEGIN, "",
             f"Measured {datetime.now(timezone.utc):%Y-%m-%d} with "
             f"`.venv/bin/python -m bench.strategies` ({platform.machine()}, "
             f"{os.cpu_count()} cores).", "",
             "| run | job | final test accuracy | vs clean run (points) | rounds committed "
             "| MB uploaded | bytes vs fp32 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['status']} | {r['accuracy']:.4f} | "
            f"{(r['accuracy'] - r['clean']) * 100:+.1f} | {r['rounds']} | "
            f"{r['bytes_up'] / 1e6:.2f} | "
            f"{r['bytes_up'] / r['clean_bytes_up'] * 100:.0f}% |")
    lines += ["", END]
    text = DOC.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    DOC.write_text(text[:start] + "\n".join(lines) + text[stop:])
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
