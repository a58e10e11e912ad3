"""Job spec validation: one line naming the field; nothing written on refusal."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from fedq.cli.demo import DEMO_SPEC
from fedq.errors import SpecError
from fedq.inference.spec import load_inference
from fedq.spec import JobSpec, load_spec, parse_spec
from fedq.testing.procs import run_module

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
        ({"clients_per_round": 9}, "spec: clients_per_round: 9 exceeds num_clients (4)"),
            ({"model_args": {"widht": 8}},
             "spec: model_args.widht: unknown argument of small_cnn (did you mean 'width'?)"),
            ({"model_args": {"width": "wide"}}, "spec: model_args.width: expected an integer"),
            ({"dataset_args": {"n_trian": 5}}, "spec: dataset_args.n_trian: unknown argument"),
            ({"reducer": {"name": "krumm"}}, "spec: reducer.name: unknown reducer 'krumm' (did "
                                             "you mean 'krum'?)"),
            ({"server": {"name": "fedadm"}}, "unknown server optimizer 'fedadm' (did you mean "
                                             "'fedadam'?)"),
            ({"servr": {"name": "fedadam"}}, "spec: servr: unknown field (did you mean "
                                             "'server'?)"),
            ({"reducer": {"name": "bulyan", "f": 1}, "min_clients": 2},
             "spec: reducer: bulyan needs at least 4f + 3 updates"),
            # each plug-in declares its own parameters: one that does nothing is refused
            ({"reducer": {"name": "mean", "beta": 0.2}},
             "spec: reducer.beta: not a parameter of mean (its parameters: none)"),
            ({"reducer": {"name": "trimmed_mean", "beta": 0.6}},
             "spec: reducer.beta: Input should be less than 0.5"),
            ({"reducer": {"name": "krum", "f": 0, "m": 2}, "clients_per_round": 3,
              "min_clients": 3},
             "spec: reducer.m: not a parameter of krum (its parameters: f)"),
            ({"server": {"name": "fedavg", "beta2": 0.9}},
             "spec: server.beta2: not a parameter of fedavg (its parameters: lr)"),
            ({"server": {"name": "fedadam", "beta_2": 0.9}},
             "spec: server.beta_2: not a parameter of fedadam (did you mean 'beta2'?)"),
            ({"server": {"name": "diloco", "lr": 0}},
             "spec: server.lr: Input should be greater than 0"),
        ({"queues": {"tpu": 2}}, "queues: unknown queue 'tpu'"),
        ({"queues": {"cpu": 1, "gpu_new": 2}}, "queues: counts sum to 3"),
        ({"model": "gpt5"}, "spec: model: unknown model 'gpt5'"),
        ({"dataset": "imagenet"}, "spec: dataset: unknown dataset 'imagenet'"),
        ({"dataset": "cifar10", "data_dir": "/nonexistent/cifar"},
         "data_dir: folder /nonexistent/cifar does not exist"),
        # DP's accountant assumes uniformly sampled rounds: a buffered job is refused
        ({"dp": {"noise_multiplier": 1.0, "clip_norm": 1.0},
          "aggregation": {"mode": "buffered", "buffer": 2}},
         "spec: dp: needs synchronous rounds (aggregation.mode: sync)"),
    ],
)
def test_invalid_spec_names_the_field(change: dict, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({**BASE, **change})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("field", ["zero_compute", "byzantine"])
def test_test_faults_are_not_spec_fields_and_stored_ones_are_dropped(field: str) -> None:
    """A job cannot turn a test fault on (fedq/testing/faults.py); a spec stored by a
    fedq that had these fields still reads."""
    with pytest.raises(SpecError, match=f"spec: {field}: unknown field"):
        parse_spec({**BASE, field: True})
    stored = {**parse_spec(BASE).to_json(), "zero_compute": False, "byzantine": None}
    assert JobSpec.stored(stored).to_json() == parse_spec(BASE).to_json()


def test_queue_mix_with_rest() -> None:
    spec = parse_spec({**BASE, "num_clients": 10, "clients_per_round": 6,
                       "queues": {"gpu_new": 2, "cpu": -1, "gpu_sm61": 1}})
    assert spec.fixed_queue_counts() == {"gpu_new": 2, "gpu_sm61": 1, "cpu": 3}


def test_local_steps_replace_epochs() -> None:
    spec = parse_spec({**BASE, "local_steps": 7})
    assert spec.local_steps == 7 and spec.local_epochs is None


def test_examples_are_valid_and_demo_matches_digits_example() -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        if path.name.startswith(("cifar", "lora_checkpoint")):
            continue  # needs folders on the machine (lora_checkpoint: tests/test_hf.py)
        if yaml.safe_load(path.read_text()).get("kind") == "inference":
            load_inference(path)
        else:
            load_spec(path)
    assert yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text()) == DEMO_SPEC


def test_bad_yaml_is_one_line_with_its_position(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("model: small_cnn\nqueues: {cpu: 2\nrounds: 1\n")
    with pytest.raises(SpecError, match=r"job.yaml:3:\d+: not valid YAML: expected ','"):
        load_spec(path)


def test_every_mistake_is_reported_with_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("model: small_cnn\n"
                    "model_args: {widht: 8}\n"
                    "dataset: digits\n"
                    "dataset_args:\n"
                    "  n_trian: 5\n"
                    "num_clients: 4\n"
                    "clients_per_round: 2\n"
                    "rounds: 0\n"
                    "reducer: {name: krumm}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    lines = str(info.value).splitlines()
    assert sorted(line.split(": ")[1] for line in lines) == [
        "dataset_args.n_trian", "model_args.widht", "reducer.name", "rounds"]
    where = {line.split(": ")[1]: line.split(": ")[0] for line in lines}
    assert where["rounds"] == f"{path}:8:1"
    assert where["model_args.widht"] == f"{path}:2:14"
    assert where["dataset_args.n_trian"] == f"{path}:5:3"
    assert where["reducer.name"] == f"{path}:9:11"


def test_allowed_names_come_from_the_registries() -> None:
    from fedq.aggregate.reducers import REDUCERS
    from fedq.aggregate.server import SERVER_OPTIMIZERS

    for name in REDUCERS:
        f = {"f": 0} if name in ("krum", "multi_krum", "bulyan") else {}
        parse_spec({**BASE, "num_clients": 8, "clients_per_round": 8, "min_clients": 8,
                    "reducer": {"name": name, **f}})
    for name in SERVER_OPTIMIZERS:
        parse_spec({**BASE, "server": {"name": name}})


def test_cli_submit_invalid_spec_writes_nothing(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({**BASE, "partition": {"kind": "dirichlet", "alpha": 0}}))
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    env["FEDQ_HOME"] = str(home)
    proc = run_module("fedq.cli", ["submit", str(spec)], env, 120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "partition.alpha: Input should be greater than 0" in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (home / "fedq.db").exists() and not (home / "blobs").exists()


def test_plugin_parameter_mistake_has_its_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**BASE, "reducer": {"name": "trimmed_mean", "bta": 0.2}},
                                   sort_keys=False))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}:8:3: reducer.bta: not a parameter of "
                                      "trimmed_mean (did you mean 'beta'?)")


def test_plugin_parameters_reach_the_plugin_and_a_stored_spec_keeps_them() -> None:
    from fedq.aggregate.reducers import make_reducer
    from fedq.aggregate.server import make_server
    from fedq.spec import JobSpec

    spec = parse_spec({**BASE, "reducer": {"name": "trimmed_mean", "beta": 0.25},
                       "server": {"name": "fedadam", "beta2": 0.9}})
    back = JobSpec.stored(spec.to_json())
    assert make_reducer(back.reducer.name, back.reducer.params()).params.beta == 0.25
    server = make_server(back.server.name, back.server.params())
    assert (server.opts.beta2, server.opts.lr) == (0.9, 0.1)  # the rest: its defaults
    # a spec stored before plug-ins declared their own parameters carried all of them
    old = JobSpec.stored({**spec.to_json(), "reducer": {"name": "mean", "beta": 0.1, "f": 1,
                                                        "m": None}})
    assert make_reducer(old.reducer.name, old.reducer.params()).name == "mean"


def test_set_changes_fields_before_the_spec_is_checked(tmp_path: Path) -> None:
    """`fedq submit SPEC --set KEY=VALUE`: dotted paths, values read as YAML, mappings
    made where missing; a mistake in one is one line naming it, and so is a value the
    spec then refuses (with the file as its place)."""
    from fedq.spec.load import apply_sets

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    spec = load_spec(path, ["rounds=7", "optimizer.lr=0.5", "optimizer.name=adamw",
                            "partition={kind: dirichlet, alpha: 0.3}", "name=set by hand"])
    assert (spec.rounds, spec.optimizer.lr, spec.optimizer.name, spec.name) == \
        (7, 0.5, "adamw", "set by hand")
    assert spec.partition.model_dump()["alpha"] == 0.3
    assert apply_sets({"a": 1}, ["b.c.d=[1, 2]"]) == {"a": 1, "b": {"c": {"d": [1, 2]}}}
    assert apply_sets(BASE, ["rounds=9"])["rounds"] == 9 and BASE["rounds"] != 9  # a copy
    for sets, line in ((["rounds"], "--set 'rounds': want KEY=VALUE"),
                       (["=3"], "--set '=3': want KEY=VALUE"),
                       (["rounds.x=1"], f"--set rounds.x: rounds is not a mapping in {path}"),
                       (["rounds=[1"], "--set rounds: its value is not YAML"),
                       (["rounds=0"], f"{path}: rounds: Input should be greater than or "
                                      "equal to 1")):
        with pytest.raises(SpecError) as info:
            load_spec(path, sets)
        assert line in str(info.value) and "\n" not in str(info.value), info.value
