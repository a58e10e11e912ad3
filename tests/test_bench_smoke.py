"""The benchmark suite at smoke sizes, so its code cannot rot (the real figures are in
docs/benchmarks.md, from `bash scripts/bench.sh`; benchmarks never assert on speed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench.common import Section
from bench.jobs import _speed_rows

ROOT = Path(__file__).resolve().parents[1]
TITLES = ["1. Round overhead", "2. Aggregation", "3. Bytes per round",
          "4. Heterogeneous time-to-accuracy", "5. Scale",
          "6. Buffered asynchronous vs synchronous",
          "7. Buffered asynchronous vs synchronous: the language model",
          "8. Where a round's time goes"]


@pytest.fixture(autouse=True)
def _forked_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks started here fork their workers from a zygote that has imported
    torch once (fedq/testing/procs.py), as the tests do: smoke sizes measure nothing."""
    monkeypatch.setenv("FEDQ_TEST_ZYGOTE", "1")


def _rows(markdown: str) -> dict[str, list[str]]:
    """The table rows of ``markdown``: first cell -> the other cells."""
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in markdown.splitlines() if line.startswith("| ") and "---" not in line}


def _interruptible(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run a benchmark; one that overruns is sent SIGTERM, so its finally blocks stop the
    worker processes and remove the network namespaces it made, and its progress so far
    is returned for the failure's message."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
        return -1, f"{stderr}\n{' '.join(cmd[1:4])} ran past {timeout:.0f} s (its output above)"
    return proc.returncode, stderr


def test_speed_rows_compare_each_mode_with_the_best_synchronous_one() -> None:
    sec = Section("t", "", ["mode", "time", "round", "total", "final", "speed-up"])
    curves = {"synchronous, wait for all": [(10.0, 1, 0.5), (20.0, 2, 0.92)],
              "synchronous, time budget 1 s": [(5.0, 1, 0.6), (12.0, 2, 0.91), (15.0, 3, 0.95)],
              "buffered K=2": [(3.0, 1, 0.7), (6.0, 2, 0.93)],
              "buffered K=3": [(4.0, 1, 0.8)]}
    hits, best_sync = _speed_rows(sec, curves, lambda accuracy: accuracy >= 0.9)
    assert best_sync == 12.0  # the faster synchronous mode, not the first
    assert hits == {"synchronous, wait for all": (20.0, 2),
                    "synchronous, time budget 1 s": (12.0, 2),
                    "buffered K=2": (6.0, 2), "buffered K=3": None}
    rows = {row[0]: row[1:] for row in sec.rows}
    assert rows["buffered K=2"] == ["6.0", "2", "6.0", "0.9300", "2.00×"]
    assert rows["synchronous, wait for all"] == ["20.0", "2", "20.0", "0.9200", "0.60×"]
    assert rows["buffered K=3"] == ["not reached", "—", "4.0", "0.8000", "—"]


def test_bad_arguments_get_one_line_and_no_file(tmp_path: Path) -> None:
    out = tmp_path / "b.md"
    proc = subprocess.run([sys.executable, "-m", "bench", "--only", "nope", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert "--only: unknown benchmark 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(900)  # a fresh machine builds Flower's environment first
def test_smoke_run_writes_every_table(tmp_path: Path, redis_db: str) -> None:
    out = tmp_path / "benchmarks.md"
    env = {**os.environ, "FEDQ_BENCH_REDIS_URL": redis_db}
    # A bench that overruns is interrupted (SIGINT: its finally blocks stop the worker
    # processes it started, which must not go on consuming from the shared Redis).
    proc = subprocess.Popen(["bash", "scripts/bench.sh", "--smoke", "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=880)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-4000:]
    assert re.search(r"fedq.testing.zygote: forked [1-9]", stderr), stderr[-4000:]
    text = out.read_text()
    assert "command: `bash scripts/bench.sh --smoke --out" in text
    assert re.search(r"versions: .*flwr 1\.42\.0", text)
    for title in TITLES:
        assert f"## {title}" in text, title
    lm = _rows(text.split("## 7. ", 1)[1].split("## 8. ", 1)[0])
    phases = _rows(text.split("## 8. ", 1)[1])
    # finalize's phases reached the table from its log, and the worker's from the rows
    assert float(phases["finalize: commit (SQL)"][1]) > 0
    assert float(phases["finalize: encode + write model"][1]) > 0
    assert float(phases["upload (encode, hash, write)"][1]) > 0
    rows = _rows(text.split("## 7. ", 1)[0])
    # the language model's buffered job ran to the end: a validation loss in nats/byte
    assert 0.5 < float(lm["buffered K=1"][3]) < 6.0 and "synchronous, wait for all" in lm
    tiny = rows["tiny (mlp, digits)"]
    fedq, floor = float(tiny[1].split()[0]), float(tiny[2].split()[0])
    assert 0 < fedq < 5 and 0 < floor < 5  # seconds per round, measured
    assert float(rows["int8+zstd"][0].split()[0]) < float(rows["none"][0].split()[0])
    assert 0.0 < float(rows["none"][2]) <= 1.0  # a real accuracy
    assert 0.0 < float(rows["buffered K=1"][3]) <= 1.0  # a buffered job ran to the end


@pytest.mark.slow
@pytest.mark.timeout(620)  # its subprocess has 600 s; a loaded machine needs more than 300
def test_lm_downlink_smoke_run_from_a_warm_start_writes_its_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/lm.py's downlink table at smoke size, into its own section of a document,
    with ``--warm N``: one data-parallel model every run starts from, each DiLoCo worker's
    download of it counted (without it, round 0's seed model is rebuilt, not moved: the
    streaming test checks that count)."""
    import bench.lm as lm
    from fedq.aggregate.compression import encode
    from fedq.weights import dumps, raw_size, state_of

    # fresh_model is the warm start's model once a --one process has set CONFIG.init
    model = lm.fresh_model_shapes()
    moved = {k: v + 1 for k, v in state_of(model).items()}
    (tmp_path / "start.safetensors").write_bytes(dumps(moved))
    monkeypatch.setattr(lm.CONFIG, "init", tmp_path / "start.safetensors")
    shapes = SimpleNamespace(input_shape=(lm.BLOCK,), num_classes=256)
    got = state_of(lm.fresh_model(shapes))  # type: ignore[arg-type]
    assert all(torch.equal(got[k], moved[k]) for k in moved)

    out = tmp_path / "lm.md"
    out.write_text("# LM\n\n<!-- begin generated tables -->\nkept\n"
                   "<!-- end generated tables -->\n")
    proc = subprocess.run([sys.executable, "-m", "bench.lm", "--smoke", "--only", "downlink",
                           "--warm", "10", "--jobs", "2", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    # a warm-start run writes its own section: the from-scratch tables stay beside it
    assert "kept" in text and "<!-- end warm-start downlink table -->" in text
    assert "<!-- end downlink table -->" not in text
    assert "--only downlink --smoke --warm 10`" in text, text
    rows = _rows(text)
    fp32, steps = rows["DiLoCo H = 10, int8 up, fp32 down"], \
        rows["DiLoCo H = 10, int8 up, int8 steps down"]
    assert float(steps[2].replace(",", "")) < float(fp32[2].replace(",", ""))  # MB moved
    assert abs(float(steps[0]) - float(fp32[0])) < 0.1  # a validation loss, close
    warm_loss = float(re.search(r"trained 10 steps by synchronous data parallel from the "
                                r"seed \(validation loss ([0-9.]+)", text)[1])  # type: ignore[index]
    assert warm_loss < 5.0  # the seed's model is near ln 256 = 5.55 nats per byte
    size = raw_size(state_of(model))
    up = raw_size(encode({k: v.float() for k, v in state_of(model).items()}, "int8", 256)[0])
    # 2 rounds x 4 workers: each uploads int8 and downloads fp32 (the warm model, then round 1's)
    assert float(fp32[2]) == round(2 * lm.WORKERS * (up + size) / 1e6, 1), (fp32, up, size)

    bad = subprocess.run([sys.executable, "-m", "bench.lm", "--warm", "-1", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "--warm must be 0 or more steps" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(620)  # its subprocess has 600 s; a loaded machine needs more than 300
def test_lm_parity_smoke_run_writes_its_table(tmp_path: Path) -> None:
    """bench/lm.py's baseline 2 against DiLoCo alone (``--only parity``), into its own
    section, with the bytes each side moves counted as the main table counts them."""
    import bench.lm as lm
    from fedq.weights import raw_size, state_of

    out = tmp_path / "lm.md"
    out.write_text("# LM\n\nkept\n")
    proc = subprocess.run([sys.executable, "-m", "bench.lm", "--smoke", "--only", "parity",
                           "--hs", "5", "--jobs", "2", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    assert "kept" in text and "<!-- end parity table -->" in text
    assert "--only parity --smoke --hs 5`" in text, text
    rows = _rows(text)
    size = raw_size(state_of(lm.fresh_model_shapes()))
    dp, fp32 = rows["2. synchronous data parallel (H = 1)"], rows["DiLoCo H = 5, fp32"]
    assert float(dp[3].replace(",", "")) == round(2 * lm.WORKERS * size * 20 / 1e6, 1)
    # 20 steps at H = 5: 4 outer steps, each worker uploads 4 times and downloads 3
    assert fp32[0] == "4" and float(fp32[3]) == round(7 * lm.WORKERS * size / 1e6, 1), fp32
    assert float(rows["DiLoCo H = 5, int8"][3]) < float(fp32[3])
    assert float(fp32[2].rstrip("%")) == pytest.approx(
        (float(fp32[1]) / float(dp[1]) - 1) * 100, abs=0.02)
    # --codecs: only the DiLoCo rows asked for, and the command says so
    proc = subprocess.run([sys.executable, "-m", "bench.lm", "--smoke", "--only", "parity",
                           "--hs", "5", "--codecs", "int8", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(out.read_text())
    assert "DiLoCo H = 5, int8" in rows and "DiLoCo H = 5, fp32" not in rows, rows
    assert "--hs 5 --codecs int8`" in out.read_text()
    bad = subprocess.run([sys.executable, "-m", "bench.lm", "--only", "parity", "--codecs",
                          "fp16", "--out", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "--codecs takes fp32 and/or int8" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(620)  # its subprocess has 600 s; a loaded machine needs more than 300
def test_lm_smoke_run_writes_every_table(tmp_path: Path) -> None:
    """The whole of bench/lm.py at smoke size: the main table, the slow-worker table and
    the downlink table, each into its own section, the GPU section left as it was."""
    import bench.lm as lm

    out = tmp_path / "lm.md"
    out.write_text("# LM\n\n<!-- begin gpu table -->\nkept\n<!-- end gpu table -->\n")
    proc = subprocess.run([sys.executable, "-m", "bench.lm", "--smoke", "--jobs", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    assert "<!-- begin gpu table -->\nkept\n" in text  # a CPU run keeps the GPU row
    assert f"x batch {lm.SMOKE_BATCH} x {lm.BLOCK} bytes" in text  # --smoke's batch
    rows = _rows(text)
    dp = float(rows["2. synchronous data parallel (H = 1)"][0])
    for name in ("1. one worker alone, all data", "3. DiLoCo H = 5, fp32",
                 "3. DiLoCo H = 10, int8", "DiLoCo H = 10, int8 up, int8 steps down"):
        assert 0 < float(rows[name][0]) < 5.6, (name, rows[name])  # below ln 256
    h5 = rows["3. DiLoCo H = 5, fp32"]
    assert h5[2] == f"{(float(h5[0]) / dp - 1) * 100:+.1f}%", h5
    _check_slow(text, 10, dp)


def _check_slow(text: str, h: int, dp: float) -> None:
    """The slow-worker table: fixed H over twice baseline 2's steps; the budget runs 4x
    its rounds in the same simulated time unless it reaches baseline 2's loss first."""
    section = text[text.index("<!-- begin slow-worker table -->"):
                   text.index("<!-- end slow-worker table -->")]
    assert f"Baseline 2's validation loss: {dp:.4f}." in section
    rows = _rows(section)
    fixed = rows[f"fixed H = {h} on every worker"]
    timed = rows[f"time budget of {h} fast steps, FedNova-normalised"]
    assert fixed[1] == "4", fixed  # 2 x 20 steps at H = 10
    assert timed[1] == "16" or timed[3] != "not reached", timed
    assert float(timed[2]) == pytest.approx(float(fixed[2]), rel=0.01) or \
        timed[3] != "not reached"  # the same simulated time: 16 rounds of 10 fast steps
    assert "its inner lr schedule following the clock (a cosine over those rounds" in section


def test_slow_table_says_how_much_sooner(tmp_path: Path) -> None:
    """write_slow's verdict line from the two curves: a ratio when both reach baseline
    2's loss, a lower bound when only the time budget does, nothing when neither."""
    import bench.lm as lm

    out = tmp_path / "lm.md"
    base2 = lm.Run("2. synchronous data parallel (H = 1)", 1.5)
    fixed = lm.Run("fixed", 1.45, curve=[(400.0, 1.7), (800.0, 1.49), (1200.0, 1.45)])
    timed = lm.Run("timed", 1.5, curve=[(100.0, 1.8), (200.0, 1.6), (300.0, 1.5)])
    lm.write_slow(out, 10, base2, fixed, timed, 0.1, 60.0, "python -m bench.lm", 40)
    assert "To baseline 2's loss, the time budget is 2.7x sooner." in out.read_text()
    fixed.curve, fixed.val_loss = [(400.0, 1.7), (800.0, 1.6)], 1.6
    lm.write_slow(out, 10, base2, fixed, timed, 0.1, 60.0, "python -m bench.lm", 40)
    text = out.read_text()
    assert "Fixed H does not reach baseline 2's loss in its 800.0 s; the time budget " \
           "reaches it in 300.0 s: at least 2.7x sooner." in text
    assert "| fixed | 1.6000 | 2 | 800.0 | not reached |" in text
    timed.curve = [(100.0, 1.8)]
    lm.write_slow(out, 10, base2, fixed, timed, 0.1, 60.0, "python -m bench.lm", 40)
    assert "sooner" not in out.read_text()


def test_time_budget_schedule_follows_the_clock() -> None:
    """The time-budgeted run's inner lr schedule is a cosine over its planned rounds on
    every worker (the rounds reach the training loop: other rounds, another model)."""
    import bench.lm as lm

    job = {"kind": "diloco", "steps": 20, "h": 10, "slow": 3, "budget": True,
           "step_time": 1.0, "max_time": 20.0, "name": "timed"}
    assert lm._timed_job(20, 10, 1.0, lm.Run("b", 1.0), lm.Run("f", 2.0, curve=[
        (40.0, 2.5), (80.0, 2.0)]))["rounds"] == 8  # 2 fixed-H rounds: 8 budget rounds
    short = lm.run_one({**job, "rounds": 2}, smoke=True)
    long = lm.run_one({**job, "rounds": 8}, smoke=True)
    assert short["rounds"] == long["rounds"] == 2
    assert short["val_loss"] != long["val_loss"]


@pytest.mark.slow
@pytest.mark.timeout(620)
def test_lm_slow_worker_smoke_run_writes_its_table(tmp_path: Path) -> None:
    """``--only slow``: the slow-worker table alone (its own runs of baseline 2 and fixed
    H), into its own section."""
    out = tmp_path / "lm.md"
    out.write_text("# LM\n\nkept\n")
    proc = subprocess.run([sys.executable, "-m", "bench.lm", "--smoke", "--only", "slow",
                           "--jobs", "2", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    assert "kept" in text and "--only slow --smoke`" in text
    # its runs were forked from a process that had imported torch (FEDQ_TEST_ZYGOTE)
    assert re.search(r"fedq.testing.zygote: forked [1-9]", proc.stderr), proc.stderr[-4000:]
    assert "<!-- begin generated tables -->" not in text
    dp = float(re.search(r"^dp: ([0-9.]+)$", proc.stdout, re.M)[1])  # type: ignore[index]
    _check_slow(text, 10, dp)


def test_lm_runs_at_a_time_share_the_cores() -> None:
    """bench.lm runs ``--jobs`` runs at a time, one process each: each takes cores / jobs
    torch threads (more oversubscribes them: docs/lm.md's H = 100 downlink pair took
    57.7 min on 2 cores with two threads each, 3.4 min with one)."""
    import bench.lm as lm

    args = SimpleNamespace(jobs=2, init=None, device="cpu", smoke=True)
    pair = lm.run_all([{"kind": "step_time", "steps": 1}] * 2, args)  # type: ignore[arg-type]
    assert all(r["seconds"] > 0 for r in pair)
    assert [r["threads"] for r in pair] == [max(1, (os.cpu_count() or 1) // 2)] * 2
    # a run with none beside it takes every core
    [alone] = lm.run_all([{"kind": "step_time", "steps": 1}], args)  # type: ignore[arg-type]
    assert alone["threads"] == (os.cpu_count() or 1)


def test_only_updates_its_sections_in_place() -> None:
    """`bash scripts/bench.sh --only X` on an existing document: X's section replaced,
    the others kept, an `updated:` line naming the run."""
    from bench.__main__ import _ONE_RUN, _update
    from bench.common import Section

    old = (f"# Benchmarks\n\nGenerated by the command below; {_ONE_RUN}.\n\n"
           "- command: `bash scripts/bench.sh`\n\n## 1. A\n\nold a\n\n## 2. B\n\nold b\n")
    new = Section("1. A", "new a", ["x"])
    text = _update(old, [new], "bash scripts/bench.sh --only a", 60)
    assert "new a" in text and "old a" not in text and "old b" in text
    assert "- updated: “1. A” by `bash scripts/bench.sh --only a`" in text
    assert _ONE_RUN not in text
    assert text.index("## 1. A") < text.index("## 2. B")
    # a second run of A: its earlier line is stale and goes; a line naming B stays
    again = _update(text.replace("\n\n## 1. A", "\n- updated: “2. B” by `b`\n\n## 1. A", 1),
                    [new], "bash scripts/bench.sh --only a", 60)
    assert again.count("- updated: “1. A”") == 1 and "- updated: “2. B” by `b`" in again


@pytest.mark.slow
@pytest.mark.timeout(620)  # its subprocess has 600 s; a loaded machine needs more than 300
def test_lm_streaming_smoke_run_writes_its_table(tmp_path: Path) -> None:
    """bench/lm.py's Streaming DiLoCo table at smoke size, into its own section."""
    out = tmp_path / "lm.md"
    out.write_text("# LM\n\nkept\n")
    proc = subprocess.run([sys.executable, "-m", "bench.lm", "--smoke", "--only", "streaming",
                           "--jobs", "2", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    assert "kept" in text and "<!-- end streaming table -->" in text
    # a progress line per round on stderr (a CPU run takes minutes per row)
    assert "Streaming DiLoCo F = 4, H = 8, fp32: round 8/8 (" in proc.stderr, proc.stderr
    rows = {name: row for name, row in _rows(text).items()
            if name.startswith(("DiLoCo", "Streaming"))}
    plain, two, four = (rows[f"{n}, H = 8, fp32"] for n in
                        ("DiLoCo", "Streaming DiLoCo F = 2", "Streaming DiLoCo F = 4"))
    assert [plain[0], two[0], four[0]] == ["2", "4", "8"]  # rounds: F per H steps
    mixed = rows["Streaming DiLoCo F = 4, H = 8, fp32, mixing 0.5"]
    assert mixed[0] == "8" and mixed[1] != four[1]  # another start each round, another loss
    peak = {name: float(r[4]) for name, r in rows.items()}
    # each round moves one fragment: the peak update falls with F, the bytes up do not grow
    assert peak["Streaming DiLoCo F = 2, H = 8, fp32"] < 0.7 * peak["DiLoCo, H = 8, fp32"]
    assert peak["Streaming DiLoCo F = 4, H = 8, fp32"] < 0.45 * peak["DiLoCo, H = 8, fp32"]
    assert float(two[3]) <= 1.01 * float(plain[3])
    # MB moved counts the downloads: DiLoCo's whole model in every round after the first
    # (round 0's is rebuilt from the seed, so 4 workers x 1 round here)
    import bench.lm as lm
    from fedq.weights import raw_size, state_of

    size = raw_size(state_of(lm.fresh_model_shapes()))
    assert abs(float(plain[5]) - float(plain[3]) - lm.WORKERS * size / 1e6) <= 0.1, plain


def test_churn_target_and_rows_per_task() -> None:
    """bench/churn.py: digits reach an accuracy (higher is better), the GPT a validation
    loss (lower is better) taken from the wait-for-all curve after 2/3 of its rounds;
    each mode's time is its first commit at the target."""
    import bench.churn as churn

    modes = ["synchronous, wait for all", "synchronous, deadline 8 s + quorum 2",
             "synchronous, time budget 2 s, quorum 2", "buffered K=2"]

    def rows(curves: list[list[tuple[float, float]]]) -> list[dict[str, object]]:
        return [{"mode": m, "curve": c, "total": c[-1][0], "final": c[-1][1],
                 "waste": 0.05, "available": 0.5} for m, c in zip(modes, curves)]

    gpt = rows([[(10.0, 3.0), (20.0, 2.8), (30.0, 2.7)], [(12.0, 2.9), (18.0, 2.75)],
                [(9.0, 3.1), (40.0, 2.9)], [(5.0, 2.9), (8.0, 2.79), (15.0, 2.6)]])
    target = churn.default_target("gpt", gpt, 3)  # 2 of 3 rounds: the second commit
    assert target == 2.8
    table = _rows("\n".join(churn.render(gpt, " --task gpt", 10, target, "gpt", 3)))
    assert table["synchronous, wait for all"][0] == "20.0"
    assert table["synchronous, deadline 8 s + quorum 2"][0] == "18.0"
    assert table["synchronous, time budget 2 s, quorum 2"][0] == "not reached"
    assert table["buffered K=2"][0] == "8.0" and table["buffered K=2"][-1] == "2.25x"
    assert table["buffered >= 1.5x sooner to validation loss 2.8000 than the best "
                 "synchronous mode"][0] == "met"
    digits = rows([[(10.0, 0.9), (20.0, 0.96)], [(10.0, 0.95)], [(9.0, 0.5)],
                   [(30.0, 0.97)]])
    assert churn.default_target("digits", digits, 12) == churn.TARGET
    table = _rows("\n".join(churn.render(digits, "", 10, 0.95)))
    assert table["synchronous, deadline 8 s + quorum 2"][-1] == "1.00x"
    assert table["buffered K=2"][0] == "30.0" and table["buffered K=2"][-1] == "0.33x"
    assert churn.sites(8) == {"p0": [0, 1], "p1": [2, 3], "p2": [4, 5], "p3": [6, 7]}
    log = "\n".join([  # a worker's log: a try yields, the next goes on from it
        "[t: INFO] Task fedq.train[fedq-j1-b1-a1] received",
        "[t: INFO] Task fedq.train[fedq-j1-b1-a1] succeeded in 1.0s: {'status': 'yielded', "
        "'steps': 0, 'error': 'on battery: after 4 of 24 steps'}",
        "[t: INFO] Task fedq.train[fedq-j1-b2-a1] received",
        "[t: INFO] resuming: 4 steps kept in memory since it yielded",
        "[t: INFO] Task fedq.train[fedq-j1-b2-a1] succeeded in 1.0s: {'status': 'yielded', "
        "'steps': 0, 'error': 'on battery: after 9 of 24 steps (4 of them kept from before)'}",
        "[t: INFO] Task fedq.train[fedq-j1-b3-a1] received",
        "[t: INFO] resuming: 9 steps kept in memory since it yielded",
        "[t: INFO] Task fedq.train[fedq-j1-b3-a1] succeeded in 1.0s: {'status': 'ok', "
        "'steps': 24, 'error': None}",
        "[t: INFO] Task fedq.train[fedq-j1-b4-a1] received",
        "[t: INFO] Task fedq.train[fedq-j1-b4-a1] succeeded in 1.0s: {'status': 'ok', "
        "'steps': 24, 'error': None}",
        "[t: INFO] Task fedq.train[fedq-j2-b1-a1] received",
        "[t: INFO] Task fedq.train[fedq-j2-b1-a1] succeeded in 1.0s: {'status': 'ok', "
        "'steps': 24, 'error': None}"])
    assert churn.trained_steps(log, "j1") == 24 + 24  # each step once; not j2's
    bound = "\n".join(churn.render(digits, " --sites", 10, 0.95, bound=True))
    assert "each client's data on one worker's machine" in bound
    assert "any worker trains any client" in "\n".join(churn.render(digits, "", 10, 0.95))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_churn_smoke_run_on_the_gpt_renders_its_table(redis_db: str) -> None:
    """bench/churn.py --task gpt --sites with one round a mode and sessions of about
    3 s: four polite workers, each holding two clients' data, come and go, every mode's
    job completes, the table renders (its figures are the full runs', in
    docs/owners.md)."""
    env = {**os.environ, "FEDQ_BENCH_REDIS_URL": redis_db}
    proc = subprocess.run([sys.executable, "-m", "bench.churn", "--task", "gpt", "--rounds",
                           "1", "--mean-s", "3", "--slowdown", "2", "--sites", "--no-write"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = _rows(proc.stdout)
    for mode in ("synchronous, wait for all", "synchronous, deadline 8 s + quorum 2",
                 "synchronous, time budget 2 s, quorum 2", "buffered K=2"):
        assert len(table[mode]) == 6, proc.stdout
        assert float(table[mode][2]) > 1.0  # a validation loss in nats per byte
    assert "--task gpt" in proc.stdout and "validation loss" in proc.stdout
    assert "--sites" in proc.stdout and "each client's data on one worker's" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_lora_smoke_run_writes_its_table(redis_db: str, tmp_path: Path) -> None:
    """bench/lora.py --smoke: a tiny checkpoint pretrained by a fedq job and exported,
    then federated LoRA, full-parameter DiLoCo and one-process LoRA jobs from it; the
    table has each run's losses and bytes, and LoRA uploads less than full DiLoCo (the
    adapters alone); a bad argument is one line."""
    from bench.lora import BEGIN, END

    out = tmp_path / "lm.md"
    out.write_text(f"# LM\n\nkept\n\n{BEGIN}\nold\n{END}\n")
    env = {**os.environ, "FEDQ_BENCH_REDIS_URL": redis_db}
    proc = subprocess.run([sys.executable, "-m", "bench.lora", "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    assert "kept" in text and "old" not in text and "bench.lora --smoke`" in text
    rows = _rows(text)
    lora, full = rows["federated LoRA (r=8, q_proj, v_proj)"], \
        rows["federated full-parameter DiLoCo"]
    single = rows["one process, LoRA, all four plays"]
    assert len(lora[0].split(" → ")) == 2 and len(single[0].split(" → ")) == 1
    assert all(1.0 < float(r[1]) < 7.0 for r in (lora, full, single))  # nats per token
    assert float(lora[2].split()[0]) < 0.1 * float(full[2].split()[0])  # MB up a round
    assert "LoRA's bytes a round <= 2% of full DiLoCo's" in rows
    bad = subprocess.run([sys.executable, "-m", "bench.lora", "--rounds", "0", "--out",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=False)
    assert bad.returncode == 2 and "--rounds: at least 1" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.timeout(120)
def test_kvcache_smoke_run_renders_its_table() -> None:
    """bench/kvcache.py --quick: the smallest GPT with and without the key-value cache,
    one prompt and eight, the same tokens both ways, and the table renders (no speed
    assertion: the figures are the full run's, in docs/inference.md)."""
    proc = subprocess.run([sys.executable, "-m", "bench.kvcache", "--quick", "--no-write"],
                          cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| a 1-layer GPT")]
    assert [r.split("|")[4].strip() for r in rows] == ["1", "8"], proc.stdout
    assert all(r.rstrip(" |").endswith("yes") for r in rows), proc.stdout


@pytest.mark.timeout(120)
def test_revoke_smoke_run_renders_its_table(redis_db: str) -> None:
    """bench/revoke.py on small counts: both ways of revoking run on the bench's Redis
    and the table renders (no speed assertion: the figures are the full run's, in
    docs/architecture.md); a bad --sizes gets one line."""
    env = {**os.environ, "FEDQ_BENCH_REDIS_URL": redis_db}
    proc = subprocess.run([sys.executable, "-m", "bench.revoke", "--sizes", "5,50",
                           "--no-write"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| 5 |", "| 50 |"))]
    assert len(rows) == 2 and all(len(r.strip("|").split("|")) == 4 for r in rows), proc.stdout
    bad = subprocess.run([sys.executable, "-m", "bench.revoke", "--sizes", "5,x"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "--sizes" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_owners_wait_smoke_run_renders_its_table(redis_db: str) -> None:
    """bench/owners.py with two yields: it unplugs the polite worker's machine twice,
    the job counts every round and update once, and the table renders (never a speed
    assertion: the figures are the full run's, in docs/owners.md)."""
    env = {**os.environ, "FEDQ_BENCH_REDIS_URL": redis_db}
    proc = subprocess.run([sys.executable, "-m", "bench.owners", "--yields", "2",
                           "--no-write"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 10 and all(c.endswith(" s") for c in cells[1:5])
    assert int(cells[6]) + int(cells[7]) >= 1  # a partial update or a task handed back
    assert int(cells[8]) >= 1 and int(cells[9]) == 2 * int(cells[8])  # two clients a round
    assert proc.stderr.count("the owner waited") == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inference_smoke_run_renders_its_tables(redis_db: str, tmp_path: Path) -> None:
    """bench/inference.py, small, in the --gpu layout on this machine (--tiny: four
    workers, SQLite, the served GPT too): the batch runs (a fast worker alone, the slow
    one alone, then all four) and the served rows at concurrency 1, 8 and 64 render for
    the CNN and the GPT; --from-json renders the same tables from the kept measurements
    (no speed assertion: the figures are the full run's, in docs/inference.md)."""
    env = {**os.environ, "FEDQ_BENCH_REDIS_URL": redis_db}
    kept = tmp_path / "inference.json"
    proc = subprocess.run([sys.executable, "-m", "bench.inference", "--gpu", "--tiny",
                           "--prompts", "16", "--requests", "32", "--no-write", "--no-ray",
                           "--json-out", str(kept)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    alone = next(line for line in out.splitlines() if line.startswith("| slow worker alone |"))
    assert alone.split("|")[4].split() == ["slow", "16"]  # the slowed worker ran alone
    both = next(line for line in out.splitlines() if line.startswith("| fedq, all 4 workers |"))
    per_worker = both.split("|")[4]
    # two full shards of 8: the fast workers take them (a shard the slow one takes is
    # copied by a free fast one at the end and may be won by it: docs/inference.md)
    assert "fast" in per_worker, per_worker
    counts = [int(part.split()[-1]) for part in per_worker.split(",")]
    assert sum(counts) == 16  # every item once
    for conc in (1, 8, 64):  # fedq serve with the CNN, the bare HTTP process, the GPT
        assert sum(line.startswith(f"| {conc} | ") for line in out.splitlines()) == 3, out
    assert "bare Starlette + uvicorn process" in out
    assert out.count("| ≤ 5 ms |") == 2 and "fedq ÷ sum of standalone items/s" in out
    assert "each worker's equal share run on it alone" in out  # the static split, run
    assert "/v1/completions" in out
    # the in-process floors of batched generation: a shard's and a served batch's
    assert "in batches of 8 (as a worker runs a shard)" in out
    assert "in batches of 32 generated together (as a worker generates a served batch)" in out
    again = subprocess.run([sys.executable, "-m", "bench.inference", "--from-json", str(kept),
                            "--no-write"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, check=False)
    assert again.returncode == 0 and again.stdout == out, again.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_share_smoke_run_renders_its_table() -> None:
    """bench/gpu_share.py, tiny, on this machine's class (the CPU here): one worker
    alone, then two sharing; every sharing worker trained its own client in the round
    the table reports, and the total is their sum."""
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_share", "--smoke", "--workers",
                           "2", "--no-write"], cwd=ROOT, capture_output=True, text=True,
                          timeout=220, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split("|") for line in proc.stdout.splitlines()
            if "@bench |" in line]
    assert [r[2].strip() for r in rows] == ["share1@bench", "share1@bench", "share2@bench"]
    assert [r[3].strip() for r in rows] == ["1", "1", "1"]  # round 2 only: one task each
    shared = [float(r[5].replace(",", "")) for r in rows[1:]]
    total = next(line for line in proc.stdout.splitlines() if line.startswith("Together"))
    assert abs(float(total.split("trained ")[1].split()[0].replace(",", "")) - sum(shared)) <= 2


@pytest.mark.slow
@pytest.mark.timeout(1260)  # its subprocess has 1,200 s: it runs beside image builds
def test_wan_smoke_run_writes_every_table(tmp_path: Path, redis_db: str) -> None:
    """bench/wan.py on the LAN preset: hosts in network namespaces (root)."""
    from fedq.testing.wan import have_netns
    from tests.conftest import missing

    why = have_netns()
    if why:
        missing("network namespaces + tbf", why)
    out = tmp_path / "wan.md"
    env = {**os.environ, "FEDQ_BENCH_REDIS_URL": redis_db}
    rc, stderr = _interruptible([sys.executable, "-m", "bench.wan", "--smoke", "--presets",
                                 "lan", "--flower-presets", "", "--out", str(out)], env, 1200)
    assert rc == 0, stderr[-4000:]
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| lan |")]
    assert len(rows) == 1 + 4  # the emulator's row and four jobs
    down = {r.split("|")[2].strip(): float(r.split("|")[3].split("/")[0]) for r in rows[1:]}
    # the model sent down as int8 steps: about a quarter of the fp32 model's bytes
    assert down["ResNet-18 zero-compute, int8 up and down"] < \
        0.3 * down["ResNet-18 zero-compute, int8"]
    cache = {name: float(row[0]) for name, row in _rows(text).items() if name in ("on", "off")}
    assert cache["off"] > 3.5 and cache["on"] < 1.5  # four workers, one download
    assert "## Buffered asynchronous vs synchronous over a WAN" in text
    assert "| buffered K=1 |" in text


def test_the_ray_comparison_refuses_settings_that_did_not_take() -> None:
    """bench/inference.py measures Ray Serve only once its replica reports the settings
    asked for (bench/ray_app.py, ``GET /``): a replica left at Ray's default
    ``max_ongoing_requests`` of 5 (its batches never fill), on another replica count or
    batch wait, or without the throughput-optimized mode stops the benchmark with the
    setting named; so does a ``max_ongoing_requests`` below the batch or the
    concurrency."""
    from bench.inference import ray_settings_problem

    cfg = {"max_ongoing_requests": 64, "replicas": 2, "max_batch": 32, "max_wait_ms": 5.0}
    took = {"max_ongoing_requests": 64, "replicas": 2, "max_batch_size": 32,
            "batch_wait_timeout_s": 0.005, "throughput_optimized": "1"}
    assert ray_settings_problem(took, cfg) is None
    for key, value in (("max_ongoing_requests", 5), ("replicas", 1),
                       ("batch_wait_timeout_s", 0.0), ("throughput_optimized", "0")):
        said = ray_settings_problem({**took, key: value}, cfg)
        assert said is not None and said.startswith(f"Ray Serve's replica reports {key} "), said
    low = {**cfg, "max_ongoing_requests": 16}
    said = ray_settings_problem({**took, "max_ongoing_requests": 16}, low)
    assert said is not None and "would never fill its batches" in said


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_inference_comparison_smoke_run_renders_its_tables(redis_db: str) -> None:
    """bench/inference.py in the CPU layout, small and without Ray: the batch job's runs
    and the served sides alternated (fedq serve with 1 and 2 workers, the batched HTTP
    floor in 1 and 2 processes, the bare one), each side's medians and ranges, and the
    targets against the floors (no speed assertion: the figures are the full run's, in
    docs/inference.md)."""
    env = {**os.environ, "FEDQ_BENCH_REDIS_URL": redis_db}
    proc = subprocess.run([sys.executable, "-m", "bench.inference", "--no-ray", "--no-write",
                           "--prompts", "32", "--requests", "24", "--big-requests", "48",
                           "--runs", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    sides = [line.split("|")[1].strip() for line in out.splitlines()
             if line.startswith(("| fedq serve,", "| batched HTTP floor", "| bare HTTP"))
             and len(line.split("|")) == 9]  # the sides' table, not the measures'
    assert "Ray Serve" not in out
    assert sides == ["fedq serve, 1 worker", "fedq serve, 2 workers",
                     "batched HTTP floor, 1 process", "batched HTTP floor, 2 processes",
                     "bare HTTP floor"], out
    assert "every side 2 times, the sides alternated" in out and "48 at 64" in out
    assert "÷ the better batched HTTP floor's" in out and "| ≤ 3 ms |" in out
    both = next(line for line in out.splitlines() if line.startswith("| fedq, both workers |"))
    assert "(" in both.split("|")[2], both  # a median and its range over the two runs
    bad = subprocess.run([sys.executable, "-m", "bench.inference", "--runs", "0"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode != 0 and "--runs and --big-requests: at least 1" in bad.stderr


def test_big_models_smoke_run_renders_a_row_per_store_and_server(redis_db: str) -> None:
    """bench/big_models.py on a 2 MB GPT with Redis chunks of 256 KB (so Redis's rows
    are lean commits), on Redis, a local folder and SeaweedFS, FedAvg and DiLoCo."""
    env = {**os.environ, "FEDQ_BENCH_REDIS_URL": redis_db}
    done = subprocess.run(
        [sys.executable, "-m", "bench.big_models", "--no-write", "--sizes", "smoke",
         "--stores", "redis,local,s3", "--chunk-mb", "0.25"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| smoke |")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [
        (store, server) for store in ("redis", "local", "s3") for server in ("fedavg", "diloco")]
    for row in rows:  # seconds, the bound and its ratio, both peaks against their targets
        assert float(row[5]) >= 0 and re.match(r" [\d.]+ \([\d.]+: (met|over)\) ", row[6]), row
        assert all(re.match(r" [\d,]+ \((met|over): [\d,]+\) ", c) for c in row[7:9]), row
        # the sampled rounds' peaks (a round this small may be too quick to sample)
        assert re.fullmatch(r" [\d,]+( / [\d,]+)*; [\d,]+( / [\d,]+)* "
                            r"\((flat|grows)\) ", row[9]), row
