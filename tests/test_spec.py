"""Job spec validation: one line naming the field; nothing written on refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedq.demo import DEMO_SPEC
from fedq.errors import SpecError
from fedq.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
BASE = {"model": "small_cnn", "dataset": "digits", "num_clients": 4, "clients_per_round": 2,
        "rounds": 1}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "red"}, "spec: colour: unknown field"),
        ({"rounds": 0}, "spec: rounds: Input should be greater than or equal to 1"),
        ({"partition": {"kind": "dirichlet", "alpha": -1}},
         "spec: partition.alpha: Input should be greater than 0"),
        ({"partition": {"kind": "zipf"}}, "spec: partition: Input tag 'zipf' found"),
        ({"optimizer": {"lr": "fast"}}, "spec: optimizer.lr: Input should be a valid number"),
        ({"clients_per_round": 9}, "clients_per_round (9) exceeds num_clients (4)"),
        ({"queues": {"tpu": 2}}, "queues: unknown queue 'tpu'"),
        ({"queues": {"cpu": 1, "gpu_new": 2}}, "queues: counts sum to 3"),
        ({"model": "gpt5"}, "spec: model: unknown model 'gpt5'"),
        ({"dataset": "imagenet"}, "spec: dataset: unknown dataset 'imagenet'"),
        ({"data_dir": "/nonexistent/cifar"}, "data_dir: folder /nonexistent/cifar does not exist"),
    ],
)
def test_invalid_spec_names_the_field(change: dict, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({**BASE, **change})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_queue_mix_with_rest() -> None:
    spec = parse_spec({**BASE, "num_clients": 10, "clients_per_round": 6,
                       "queues": {"gpu_new": 2, "cpu": -1, "gpu_sm61": 1}})
    assert spec.queue_counts() == {"gpu_new": 2, "gpu_sm61": 1, "cpu": 3}


def test_local_steps_replace_epochs() -> None:
    spec = parse_spec({**BASE, "local_steps": 7})
    assert spec.local_steps == 7 and spec.local_epochs is None


def test_examples_are_valid_and_demo_matches_digits_example() -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        if path.name.startswith("cifar"):
            continue  # needs a data_dir on the machine
        load_spec(path)
    assert yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text()) == DEMO_SPEC


def test_bad_yaml_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(SpecError, match=r"job.yaml: not valid YAML"):
        load_spec(path)


def test_cli_submit_invalid_spec_writes_nothing(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({**BASE, "partition": {"kind": "dirichlet", "alpha": 0}}))
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    env["FEDQ_HOME"] = str(home)
    proc = subprocess.run([sys.executable, "-m", "fedq.cli", "submit", str(spec)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "partition.alpha: Input should be greater than 0" in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (home / "fedq.db").exists() and not (home / "blobs").exists()
