"""Every job spec option x {sync, buffered}: the option changes what the job does,
or the spec refuses it for that mode with one line naming it. No option is ignored in
silence.

The table below holds one row per option, found by walking the spec's schema and each
plug-in's declared parameters (a new option without a row fails
:func:`test_the_table_holds_every_option`). A cell is

- a probe, run here through the code the mode itself runs: the training task as that
  mode's dispatcher builds it (``Sent.train_ref``) through the worker's
  ``run_training`` (``update``); the mode's aggregation (``commit.aggregate``, with a
  buffered version's staleness factors from ``buffered.staleness_factors``, and its
  K/C server step) for fixed updates (``model``, and ``privacy`` for the epsilon it
  records); the mode's plan of who trains on
  which queue (``plan_round`` / ``buffered.pick_client``) (``plan``); the decisions
  the mode reads the option through (``decision``). Each compares the spec with and
  without the change and asserts a difference;
- ``Refused``: the spec refuses the option in that mode, naming it;
- ``Tested``: the effect needs a running cluster (deadlines, dispatch counts, kept
  blobs) and is asserted by the named test, which must exist.
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from fedq.aggregate import Accumulator
from fedq.blobs import BlobStore, global_key, open_store
from fedq.coordinator import buffered, commit, policy
from fedq.coordinator.evaluation import initial_weights
from fedq.coordinator.intake import Sent
from fedq.coordinator.pipeline import Outcome
from fedq.coordinator.planning import plan_round, queue_counts
from fedq.errors import SpecError
from fedq.process import PROCESS
from fedq.protocol.training import TrainStats, UpdateRef
from fedq.spec import JobSpec, parse_spec
from fedq.weights import dumps
from fedq.worker.update import run_training

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sync", "buffered")
BASE: dict[str, Any] = {"model": "small_cnn", "dataset": "digits", "num_clients": 8,
                        "clients_per_round": 7, "rounds": 2, "local_steps": 3,
                        "batch_size": 16, "seed": 3}
MODE_BASE = {"sync": BASE,
             "buffered": {**BASE, "aggregation": {"mode": "buffered", "buffer": 7}}}
UPDATES = 7  # updates the model probe aggregates (Bulyan with f 1 needs 7)


@dataclass(frozen=True)
class Refused:
    why: str  # a part of the spec's message


@dataclass(frozen=True)
class Tested:
    __test__ = False  # not a pytest class
    test: str  # file::function asserting the effect in this mode


Probe = Callable[[JobSpec, JobSpec, str, Path], None]
Cell = Probe | Refused | Tested


def update(base: JobSpec, changed: JobSpec, mode: str, tmp: Path) -> None:
    """The update client 0 sends for the mode's task differs."""
    assert _train(base, mode, tmp / "a") != _train(changed, mode, tmp / "b")


def model(base: JobSpec, changed: JobSpec, mode: str, tmp: Path) -> None:
    """The mode's new model (weights, evaluation, privacy spent, step) differs."""
    assert _aggregate(base, mode, tmp / "a") != _aggregate(changed, mode, tmp / "b")


def privacy(base: JobSpec, changed: JobSpec, mode: str, tmp: Path) -> None:
    """The privacy spent that the mode's commit records differs (DP's noise itself is
    random: the weights would differ anyway)."""
    spent = [_aggregate(s, mode, tmp / name)[2] for s, name in ((base, "a"), (changed, "b"))]
    assert None not in spent and spent[0] != spent[1]


def plan(base: JobSpec, changed: JobSpec, mode: str, tmp: Path) -> None:
    """Who trains on which queue differs."""
    assert _plan(base, mode) != _plan(changed, mode)


def decision(base: JobSpec, changed: JobSpec, mode: str, tmp: Path) -> None:
    """A decision the mode takes from the spec differs."""
    assert _decide(base, mode) != _decide(changed, mode)


def _train(spec: JobSpec, mode: str, tmp: Path) -> tuple[str, int]:
    PROCESS.clear()
    store = open_store(str(tmp / "blobs"))
    blob = store.put(global_key("j", 0), dumps(initial_weights(spec)))
    sent = Sent("j", 1, 0, 1, 0 if mode == "buffered" else 5, "cpu",
                task=3 if mode == "buffered" else 0)
    out = UpdateRef.from_json(run_training(sent.train_ref(spec.to_json(), blob).to_json(),
                                           store, "w"))
    assert out.status == "ok", out.error
    return out.sha256 or "", out.bytes_up


def _aggregate(spec: JobSpec, mode: str, tmp: Path) -> tuple[Any, ...]:
    """Two rounds (versions) from the same updates: the second starts from the first's
    model and server state (momentum). A round verification leaves below its quorum
    ends it: nothing is committed."""
    PROCESS.clear()
    store = open_store(str(tmp / "blobs"))
    current = initial_weights(spec)
    blob = store.put(global_key("j", 0), dumps(current))
    state, out = None, []
    for number in (1, 2):
        new = _one(spec, mode, store, number, current, blob.sha256, state, tmp)
        if new is None:
            return (*out, "below the quorum: nothing committed")
        current, blob, state = new.weights, new.blob, new.state
        out += [new.blob.sha256, new.accuracy, new.epsilon, new.step is None]
    return tuple(out)


def _one(spec: JobSpec, mode: str, store: BlobStore, number: int, current: Any, sha256: str,
         state: Any, tmp: Path) -> commit.NewModel | None:
    refs, staleness = [], {}
    gen = torch.Generator().manual_seed(number)
    for i in range(UPDATES):
        delta = {k: 0.01 * torch.randn(v.shape, generator=gen) * (1 + i)
                 if v.dtype.is_floating_point else torch.zeros_like(v)
                 for k, v in current.items()}
        put = store.put(f"u/{number}/{i}", dumps(delta))
        task = i + 1 + UPDATES * (number - 1)
        refs.append(UpdateRef(status="ok", job="j", round=number,
                              task=task if mode == "buffered" else 0, client=i,
                              queue="cpu", worker="w", key=put.key,
                              sha256=put.sha256, samples=10 + 20 * i, steps=1 + i,
                              bytes_up=put.size, stats=TrainStats(seen=50 * (i % 3 + 1))))
        staleness[task] = i % 4
    factors = buffered.staleness_factors(spec, staleness) if mode == "buffered" else None
    new = commit.aggregate(spec, store, "j", number, refs, current, sha256, state, Outcome(),
                           tmp / "scratch", Accumulator(), factors)
    return new


def _plan(spec: JobSpec, mode: str) -> Any:
    if mode == "sync":
        return plan_round(spec, 1)
    return [buffered.pick_client(spec, t, set()) for t in range(1, 9)], queue_counts(spec)


def _decide(spec: JobSpec, mode: str) -> Any:
    if mode == "sync":
        return spec.quorum
    return policy.absorb_status("ok", True, True, 1, spec.rounds, 3,
                                spec.aggregation.max_staleness)


def both(cell: Cell) -> tuple[Cell, Cell]:
    return cell, cell


SYNC_ONLY = Refused("needs synchronous rounds")
BUFFERED_ONLY = Refused("only used by buffered jobs")

#: option -> (context, change, (sync cell, buffered cell)). ``context`` is merged into
#: both specs (what the option needs to mean something), ``change`` into one of them;
#: each is one dict, or one per mode.
Part = dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]
TABLE: dict[str, tuple[Part, Part, tuple[Cell, Cell]]] = {
    # the job's name labels it (rows, `fedq status`, metrics); submit writes it for both
    "name": ({}, {"name": "other"}, both(Tested("tests/test_observe.py::"
                                                "test_metrics_endpoint_scraped"))),
    "model": ({}, {"model": "mlp"}, both(update)),
    "model_args": ({}, {"model_args": {"width": 8}}, both(update)),
    "dataset": ({}, {"dataset": "synthetic", "dataset_args": {"n_train": 400, "n_test": 100}},
                both(update)),
    "data_dir": ({}, {"data_dir": str(ROOT)}, both(Refused("data_dir: not used by dataset"))),
    "dataset_args": ({"dataset": "synthetic", "dataset_args": {"n_train": 400, "n_test": 100}},
                     {"dataset_args": {"n_train": 300, "n_test": 100}}, both(update)),
    "partition": ({}, {"partition": {"kind": "dirichlet", "alpha": 0.1}}, both(update)),
    "num_clients": ({}, {"num_clients": 9}, both(plan)),
    "clients_per_round": ({}, ({"clients_per_round": 6},
                               {"clients_per_round": 6, "aggregation": {"buffer": 6}}),
                          both(plan)),
    "rounds": ({"eval_every": 2}, {"rounds": 1}, both(model)),  # the last round is evaluated
    "local_epochs": ({"local_steps": None}, {"local_epochs": 2}, both(update)),
    "local_steps": ({}, {"local_steps": 4}, both(update)),
    "batch_size": ({}, {"batch_size": 8}, both(update)),
    "optimizer.name": ({}, {"optimizer": {"name": "adam", "lr": 0.001}}, both(update)),
    "optimizer.lr": ({}, {"optimizer": {"lr": 0.01}}, both(update)),
    "optimizer.momentum": ({}, {"optimizer": {"momentum": 0.9}}, both(update)),
    "optimizer.weight_decay": ({}, {"optimizer": {"weight_decay": 0.5}}, both(update)),
    "optimizer.beta2": ({"optimizer": {"name": "adam", "lr": 0.001}},
                        {"optimizer": {"beta2": 0.5}}, both(update)),
    "optimizer.warmup_steps": ({}, {"optimizer": {"warmup_steps": 2}}, both(update)),
    "optimizer.schedule": ({}, {"optimizer": {"schedule": "cosine", "schedule_steps": 3}},
                           both(update)),
    "optimizer.schedule_steps": ({"optimizer": {"schedule": "cosine"}},
                                 {"optimizer": {"schedule_steps": 2}}, both(update)),
    "optimizer.final_lr_fraction": ({"optimizer": {"schedule": "cosine", "schedule_steps": 3}},
                                    {"optimizer": {"final_lr_fraction": 0.9}}, both(update)),
    "optimizer.grad_clip": ({}, {"optimizer": {"grad_clip": 1e-4}}, both(update)),
    "optimizer.keep_state": ({}, {"optimizer": {"keep_state": True}}, both(Tested(
        "tests/test_lm.py::test_diloco_inner_state_survives_rounds_and_a_worker_restart"))),
    "queues": ({}, {"queues": {"gpu_new": 2, "cpu": -1}}, both(plan)),
    "clients_per_worker": ({}, {"clients_per_worker": 2}, (
        Tested("tests/test_owner.py::test_a_round_is_sized_by_the_workers_that_can_train_now"),
        Refused("sizes synchronous rounds"))),
    "sites": ({}, {"sites": {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}}, (plan, Tested(
        "tests/test_sites.py::test_each_clients_task_trains_at_its_site_and_an_away_site_"
        "waits"))),
    "time_budget_s": ({}, {"time_budget_s": 1e-6}, both(update)),
    "weight_by": ({}, {"weight_by": "processed"}, both(model)),
    "server.name": ({}, {"server": {"name": "fedadam"}}, both(model)),
    "server.lr": ({}, {"server": {"lr": 0.3}}, both(model)),
    "server.momentum": ({"server": {"name": "fedavgm"}}, {"server": {"momentum": 0.5}},
                        both(model)),
    "server.beta2": ({"server": {"name": "fedadam"}}, {"server": {"beta2": 0.5}}, both(model)),
    "server.tau": ({"server": {"name": "fedadam"}}, {"server": {"tau": 0.5}}, both(model)),
    "reducer.name": ({}, {"reducer": {"name": "median"}}, both(model)),
    "reducer.beta": ({"reducer": {"name": "trimmed_mean"}}, {"reducer": {"beta": 0.3}},
                     both(model)),
    "reducer.f": (({"reducer": {"name": "multi_krum", "f": 1}, "min_clients": 7},
                   {"reducer": {"name": "multi_krum", "f": 1}}), {"reducer": {"f": 3}},
                  both(model)),
    "reducer.m": (({"reducer": {"name": "multi_krum", "f": 1}, "min_clients": 7},
                   {"reducer": {"name": "multi_krum", "f": 1}}), {"reducer": {"m": 2}},
                  both(model)),
    "clip_norm": ({}, {"clip_norm": 0.01}, both(model)),
    "dp.noise_multiplier": ({"dp": {"noise_multiplier": 0.0, "clip_norm": 1.0}},
                            {"dp": {"noise_multiplier": 1.0}}, (privacy, SYNC_ONLY)),
    "dp.clip_norm": ({"dp": {"noise_multiplier": 0.0, "clip_norm": 1.0}},
                     {"dp": {"clip_norm": 0.01}}, (model, SYNC_ONLY)),
    "dp.delta": ({"dp": {"noise_multiplier": 1.0, "clip_norm": 1.0}}, {"dp": {"delta": 0.1}},
                 (privacy, SYNC_ONLY)),
    "compression.codec": ({}, {"compression": {"codec": "fp16"}}, both(update)),
    "compression.zstd": ({}, {"compression": {"zstd": True}}, both(update)),
    "compression.chunk": ({"compression": {"codec": "int8"}}, {"compression": {"chunk": 64}},
                          both(update)),
    "compression.slow_link_mbit": ({"compression": {"codec": "auto"}},
                                   {"compression": {"slow_link_mbit": 5}}, both(Tested(
                                       "tests/test_wan.py::"
                                       "test_codec_auto_follows_the_declared_uplink"))),
    "compression.downlink": ({}, {"compression": {"downlink": "int8"}}, both(model)),
    "streaming.fragments": ({"server": {"name": "diloco"}},
                            {"streaming": {"fragments": 2}},
                            (Tested("tests/test_streaming.py::"
                                    "test_a_streaming_job_synchronises_one_fragment_per_round"),
                             SYNC_ONLY)),
    "streaming.mixing": ({"streaming": {"fragments": 2}}, {"streaming": {"mixing": 0.5}},
                         (Tested("tests/test_streaming.py::"
                                 "test_mixing_merges_a_synchronised_fragment_with_the_local_one"),
                          SYNC_ONLY)),
    "prox_mu": ({}, {"prox_mu": 5.0}, both(update)),
    "min_clients": ({}, {"min_clients": 3}, (decision, Refused("not used by a buffered job"))),
    "min_fraction": ({}, {"min_fraction": 0.5}, (decision, Refused("not used by a buffered job"))),
    "round_timeout_s": ({}, {"round_timeout_s": 5}, (
        Tested("tests/test_faults.py::test_worker_paused_past_the_deadline_is_late_and_never_"
               "averaged"),
        Tested("tests/test_buffered.py::test_buffered_worker_killed_mid_task"))),
    "max_redispatch": ({}, {"max_redispatch": 0}, (
        Tested("tests/test_faults.py::test_quorum_failure_redispatches_then_fails_then_resumes"),
        Tested("tests/test_buffered.py::"
               "test_buffered_job_whose_tasks_all_fail_stops_with_a_reason"))),
    "max_update_norm": ({}, {"max_update_norm": 4.0}, both(model)),  # norms 1.1 .. 7.8
    "max_updates_per_worker": ({}, {"max_updates_per_worker": 1}, both(Tested(
        "tests/test_identity.py::test_one_registered_machine_counts_at_most_its_cap_however_"
        "many_processes_it_runs"))),
    "seed": ({}, {"seed": 4}, both(update)),
    "keep_updates": ({}, {"keep_updates": 0}, both(Tested(
        "tests/test_strategy_jobs.py::test_keep_updates_in_both_modes"))),
    "eval_every": ({}, {"eval_every": 0}, both(model)),
    "aggregation.mode": ({}, {"aggregation": {"mode": "buffered"}}, both(Tested(
        "tests/test_buffered.py::test_buffered_job_on_the_embedded_default"))),
    "aggregation.buffer": ({}, {"aggregation": {"buffer": 3}}, (BUFFERED_ONLY, model)),
    "aggregation.max_staleness": ({}, {"aggregation": {"max_staleness": 1}},
                                  (BUFFERED_ONLY, decision)),
    "aggregation.staleness.kind": ({}, {"aggregation": {"staleness": {"kind": "constant"}}},
                                   (BUFFERED_ONLY, model)),
    "aggregation.staleness.a": ({}, {"aggregation": {"staleness": {"a": 2.0}}},
                                (BUFFERED_ONLY, model)),
    "aggregation.staleness.b": ({"aggregation": {"staleness": {"kind": "hinge"}}},
                                {"aggregation": {"staleness": {"b": 0}}},
                                (BUFFERED_ONLY, model)),
}


def _options(model_cls: type[BaseModel] = JobSpec, prefix: str = "") -> list[str]:
    """Every option: the schema's leaves (a partition is one option) and each plug-in's
    declared parameters."""
    out = []
    for name, field in model_cls.model_fields.items():
        ann = field.annotation
        subs = [a for a in (ann, *typing.get_args(ann))
                if isinstance(a, type) and issubclass(a, BaseModel)]
        if subs and name != "partition":
            out += _options(subs[0], f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    from fedq.aggregate.reducers import REDUCERS
    from fedq.aggregate.server import SERVER_OPTIMIZERS

    if not prefix:
        for section, table in (("server", SERVER_OPTIMIZERS), ("reducer", REDUCERS)):
            out += sorted({f"{section}.{p}" for cls in table.values()
                           for p in cls.Params.model_fields})
    return out


def _merge(into: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(into)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "queues":
            out[key] = _merge(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def test_the_table_holds_every_option() -> None:
    assert sorted(TABLE) == sorted(_options())


def test_every_tested_cell_names_a_test_that_exists() -> None:
    for option, (_, _, cells) in TABLE.items():
        for cell in cells:
            if isinstance(cell, Tested):
                path, _, name = cell.test.partition("::")
                assert f"\ndef {name}(" in (ROOT / path).read_text(), (option, cell.test)


@pytest.mark.parametrize(("option", "mode"), [
    (option, mode) for option, (_, _, cells) in sorted(TABLE.items())
    for mode, cell in zip(MODES, cells, strict=True) if not isinstance(cell, Tested)])
def test_option_in_mode(option: str, mode: str, tmp_path: Path) -> None:
    context, change, cells = TABLE[option]
    cell = cells[MODES.index(mode)]
    assert not isinstance(cell, Tested)
    if isinstance(context, tuple):
        context = context[MODES.index(mode)]
    if isinstance(change, tuple):
        change = change[MODES.index(mode)]
    base = _merge(MODE_BASE[mode], context)
    if isinstance(cell, Refused):
        with pytest.raises(SpecError) as info:
            parse_spec(_merge(base, change))
        assert option.split(".")[0] in str(info.value) and cell.why in str(info.value)
        return
    cell(parse_spec(base), parse_spec(_merge(base, change)), mode, tmp_path)
