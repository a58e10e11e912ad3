"""The job spec's schema: what a person writes in ``job.yaml``, every field with its
bounds and a comment-sized description, and the rules that involve more than one field
(:meth:`JobSpec.problems`), among them every option a mode would ignore, refused.

The allowed names of models, datasets, reducers and server optimizers, and the
reducers' and server optimizers' parameters, come from their registries
(fedq/registry.py); ``model_args`` and ``dataset_args`` are checked against the
constructor's signature. Reading a file and reporting mistakes by line is
fedq/spec/load.py.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fedq.data.partition import IIDPartition, Partition
from fedq.engine.names import SITE_NAME_PATTERN, TRAINING_QUEUES, site_queue

# The registries (models, data sets, reducers, server optimizers) import torch, which
# takes seconds. They are imported inside the checks below, which a stored spec (one
# validated at submit, read back by `fedq status`, a worker or finalize) skips: see
# JobSpec.stored.

def _registries() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(MODELS, DATASETS, REDUCERS, SERVER_OPTIMIZERS)."""
    from fedq.aggregate.reducers import REDUCERS
    from fedq.aggregate.server import SERVER_OPTIMIZERS
    from fedq.data.datasets import DATASETS
    from fedq.models.registry import MODELS

    return MODELS, DATASETS, REDUCERS, SERVER_OPTIMIZERS


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _one_of(kind: str, value: str, known: dict[str, Any] | tuple[str, ...]) -> str:
    """``value`` if it is a known name, else a ValueError with a suggestion."""
    if value not in known:
        raise ValueError(f"unknown {kind} {value!r}{_did_you_mean(value, list(known))} "
                         f"(known: {', '.join(known)})")
    return value


class OptimizerSpec(_Strict):
    """The client's local optimizer."""

    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(default=0.05, gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    beta2: float = Field(default=0.999, gt=0, lt=1, description="adam/adamw second moment")
    warmup_steps: int = Field(default=0, ge=0, description="linear warm-up of the lr")
    schedule: Literal["constant", "cosine"] = Field(
        default="constant", description="lr after warm-up: constant, or cosine decay to "
                                        "final_lr_fraction x lr over schedule_steps")
    schedule_steps: int | None = Field(
        default=None, ge=1, description="cosine horizon in inner steps per client "
                                        "(default: rounds x local_steps)")
    final_lr_fraction: float = Field(default=0.1, ge=0, le=1)
    grad_clip: float | None = Field(default=None, gt=0, description="clip the gradient norm")
    keep_state: bool = Field(
        default=False, description="keep this client's optimizer state and step count "
                                   "from round to round on the worker's disk (DiLoCo's "
                                   "inner AdamW); a worker restart keeps it")


class _PluginSpec(BaseModel):
    """A plug-in by ``name`` and its parameters, the section's other keys: the plug-in
    declares them (its ``Params``, fedq/aggregate/plugin.py) and :meth:`JobSpec.problems`
    checks them against that declaration."""

    model_config = ConfigDict(extra="allow", frozen=True)

    #: (the plug-in kind's word in errors, its index in :func:`_registries`)
    kind: ClassVar[tuple[str, int]]
    name: str

    @field_validator("name")
    @classmethod
    def _known(cls, v: str, info: ValidationInfo) -> str:
        word, index = cls.kind
        return v if _stored(info) else _one_of(word, v, _registries()[index])

    def params(self) -> dict[str, Any]:
        """The parameters set (None: unset, the plug-in's default)."""
        return {k: v for k, v in (self.model_extra or {}).items() if v is not None}

    def summary(self) -> str:
        """``trimmed_mean (beta 0.2)``: the name and the parameters set."""
        args = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in self.params().items())
        return f"{self.name} ({args})" if args else self.name


class ServerSpec(_PluginSpec):
    """The server optimizer over the aggregated delta (fedq/aggregate/server/) and its
    parameters (e.g. ``lr``, ``momentum``); unset ones take the optimizer's defaults."""

    kind = ("server optimizer", 3)
    name: str = Field(default="fedavg", description="a name from fedq/aggregate/server/")


class ReducerSpec(_PluginSpec):
    """How client updates are combined (fedq/aggregate/reducers/): a weighted mean,
    FedNova, or a robust reducer (unweighted), and its parameters (e.g. ``beta``,
    ``f``)."""

    kind = ("reducer", 2)
    name: str = Field(default="mean", description="a name from fedq/aggregate/reducers/")


class DPSpec(_Strict):
    """Central differential privacy: clip each update, add Gaussian noise to the mean."""

    noise_multiplier: float = Field(ge=0)
    clip_norm: float = Field(gt=0)
    delta: float = Field(default=1e-5, gt=0, lt=1)


class StreamingSpec(_Strict):
    """Streaming DiLoCo (arXiv:2501.18512; fedq/aggregate/streaming.py): the model is
    synchronised in ``fragments`` parts, one per round in turn; each worker keeps its
    clients' own copies of the model between rounds, and each update carries one
    fragment (1/F of the bytes up)."""

    fragments: int = Field(ge=2, le=64, description="F: parts of the model, one synchronised "
                                                    "per round")
    mixing: float = Field(
        default=0.0, ge=0, lt=1,
        description="alpha: a fragment synchronised since a client's last round becomes "
                    "alpha x its local value + (1 - alpha) x the global one (0: the global "
                    "value alone)")


class CompressionSpec(_Strict):
    """How updates travel up (fedq/aggregate/compression.py) and, with ``downlink``,
    the new global model down (fedq/aggregate/downlink.py)."""

    codec: Literal["none", "fp16", "int8", "auto"] = "none"
    zstd: bool = False
    chunk: int = Field(default=256, ge=8, description="int8: elements per scale")
    slow_link_mbit: float = Field(
        default=100.0, gt=0, description="auto: int8 on a worker whose uplink is "
        "slower than this (Mbit/s), fp32 otherwise and while it is not yet measured")
    downlink: Literal["none", "int8"] = Field(
        default="none", description="int8: each new global model is also published as "
        "an int8 step from the previous one (error feedback on the coordinator), which a "
        "worker holding the previous model downloads instead of the full model "
        "(fedq/aggregate/downlink.py)")


class StalenessSpec(_Strict):
    """How an update's weight falls with its staleness (fedq/aggregate/staleness.py)."""

    kind: Literal["constant", "polynomial", "hinge"] = "polynomial"
    a: float = Field(default=0.5, ge=0, description="polynomial exponent / hinge slope")
    b: int = Field(default=10, ge=0, description="hinge: staleness with full weight")


class AggregationSpec(_Strict):
    """Synchronous rounds (the default), or buffered asynchronous aggregation (FedBuff):
    ``clients_per_round`` tasks train at all times, and a new model version is made
    whenever ``buffer`` updates have arrived (fedq/coordinator/buffered.py)."""

    mode: Literal["sync", "buffered"] = "sync"
    buffer: int = Field(default=4, ge=1, description="buffered: updates per model version (K)")
    max_staleness: int | None = Field(
        default=None, ge=0, description="buffered: updates more versions old are recorded "
                                        "as stale and not used (unset: no limit)")
    staleness: StalenessSpec = Field(default_factory=StalenessSpec)

    def server_lr(self, server: "ServerSpec", concurrency: int) -> float | None:
        """The server step size a buffered job uses: the spec's, or for FedAvg and
        FedAvgM left unset, K / clients_per_round. A version is applied every K updates
        instead of every C, so a full-size step per version would move the model C/K
        times as far per unit of client work; measured on digits (docs/strategies.md):
        lr 1 with K=3 of C=6 oscillates (best 0.76), K/C = 0.5 tracks synchronous."""
        lr = server.params().get("lr")
        if lr is not None or server.name not in ("fedavg", "fedavgm"):
            return lr
        return self.buffer / concurrency


#: Spec fields that a stored spec may still carry and that mean nothing now: the test
#: faults are environment variables of the processes a test starts
#: (fedq/testing/faults.py), never a job's.
RETIRED = ("zero_compute", "byzantine")


class JobSpec(_Strict):
    """One federated training job. Every field has a comment-sized description."""

    name: str = Field(default="job", min_length=1, max_length=100)
    model: str = Field(description="model registry name, e.g. small_cnn, resnet18_cifar")
    model_args: dict[str, Any] = Field(default_factory=dict, description="extra model kwargs")
    dataset: str = Field(description="digits, cifar10 or synthetic")
    data_dir: str | None = Field(default=None, description="where the dataset lives (cifar10)")
    dataset_args: dict[str, Any] = Field(default_factory=dict, description="e.g. synthetic size")
    partition: Partition = Field(default_factory=IIDPartition)
    num_clients: int = Field(ge=1, le=100_000, description="clients the data is split into")
    clients_per_round: int = Field(ge=1, description="clients sampled each round")
    clients_per_worker: int | None = Field(
        default=None, ge=1, description="size each round by who can train now: this many "
                                        "clients per available worker slot (a worker started "
                                        "with -c N has N), from the quorum up "
                                        "to clients_per_round (unset: every round takes "
                                        "clients_per_round)")
    rounds: int = Field(ge=1, le=100_000)
    local_epochs: int | None = Field(default=1, ge=1, description="passes over the shard")
    local_steps: int | None = Field(default=None, ge=1, description="or a fixed step count")
    batch_size: int = Field(default=32, ge=1)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    queues: dict[str, int] | Literal["auto"] = Field(
        default_factory=lambda: {"cpu": -1},
        description="tasks per round per queue; -1 on one queue means 'the rest'; 'auto' "
                    "splits each round by the live workers' measured throughput",
    )
    sites: dict[str, list[int]] | None = Field(
        default=None,
        description="where each client's data lives: site name -> its clients; a client's "
                    "task goes only to the queue site.<name>, which the workers at that "
                    "site consume (unset: any worker of the job's queues trains any client)")
    time_budget_s: float | None = Field(
        default=None, gt=0, description="each task stops training after this many seconds; "
                                        "a cosine lr schedule then follows the job's clock")
    weight_by: Literal["samples", "processed"] = Field(
        default="samples", description="FedAvg weight: shard size, or samples processed")
    server: ServerSpec = Field(default_factory=ServerSpec)
    reducer: ReducerSpec = Field(default_factory=ReducerSpec)
    clip_norm: float | None = Field(default=None, gt=0, description="clip each update's L2 norm")
    dp: DPSpec | None = None
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    streaming: StreamingSpec | None = Field(
        default=None, description="Streaming DiLoCo: synchronise one of F fragments per round")
    prox_mu: float = Field(default=0.0, ge=0, description="FedProx proximal term (0: off)")
    min_clients: int = Field(default=1, ge=1, description="usable updates a round needs")
    min_fraction: float | None = Field(
        default=None, gt=0, le=1, description="or this fraction of clients_per_round")
    round_timeout_s: float = Field(
        default=600.0, gt=0, description="round deadline: finalize with the quorum, or "
                                         "re-dispatch the missing clients")
    max_redispatch: int = Field(
        default=2, ge=0, description="times a round's missing clients are sent again")
    max_update_norm: float | None = Field(default=None, gt=0, description="reject larger updates")
    max_updates_per_worker: int | None = Field(
        default=None, ge=1, description="updates one worker may count in a round or version "
                                        "(by its signer with FEDQ_IDENTITY=required); unset: "
                                        "no cap")
    seed: int = Field(default=0, ge=0)
    keep_updates: int | None = Field(
        default=None, ge=0, description="keep the update blobs of this many latest rounds "
                                        "(0: delete each round's updates once it commits); "
                                        "unset: keep all. Global models are always kept")
    eval_every: int = Field(
        default=1, ge=0, description="evaluate the global model on the test split every N "
                                     "rounds and after the last; 0: never")
    aggregation: AggregationSpec = Field(default_factory=AggregationSpec)

    @classmethod
    def stored(cls, data: dict[str, Any]) -> "JobSpec":
        """A spec validated at submit and read back (from the database or a TrainRef):
        its shape is checked again, its names against the registries are not. Keys in
        :data:`RETIRED` are dropped: a stored spec may carry them, a new one may not."""
        kept = {k: v for k, v in data.items() if k not in RETIRED}
        return cls.model_validate(kept, context={"stored": True})

    @field_validator("model")
    @classmethod
    def _model_known(cls, v: str, info: ValidationInfo) -> str:
        return v if _stored(info) else _one_of("model", v, _registries()[0])

    @field_validator("dataset")
    @classmethod
    def _dataset_known(cls, v: str, info: ValidationInfo) -> str:
        return v if _stored(info) else _one_of("dataset", v, _registries()[1])

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> "JobSpec":
        if self.local_steps is not None:
            object.__setattr__(self, "local_epochs", None)
        if _stored(info):
            return self
        problems = list(self.problems())
        if problems:
            raise ValueError("\n".join(f"{field}: {msg}" for field, msg in problems))
        return self

    def problems(self) -> Iterator[tuple[str, str]]:
        """(field, message) for every rule that involves more than one field."""
        from fedq.aggregate import plugin
        from fedq.aggregate.reducers import make_reducer
        from fedq.data.datasets import READS_DATA_DIR

        models, datasets, reducers, servers = _registries()
        for field, table, section in (("reducer", reducers, self.reducer),
                                      ("server", servers, self.server)):
            yield from plugin.problems(field, section.name, table[section.name].Params,
                                       section.params())
        if self.clients_per_round > self.num_clients:
            yield ("clients_per_round", f"{self.clients_per_round} exceeds num_clients "
                                        f"({self.num_clients})")
        if self.buffered:
            for name in sorted(_changed(self) & {"min_clients", "min_fraction"}):
                yield (name, "not used by a buffered job: each model version takes "
                             "aggregation.buffer updates")
        elif self.quorum > self.clients_per_round:
            yield ("min_clients", f"{self.quorum} exceeds clients_per_round "
                                  f"({self.clients_per_round})")
        yield from self._unused()
        yield from self._sizing_problems()
        if self.streaming is not None and self.buffered:
            yield ("streaming", "needs synchronous rounds (aggregation.mode: sync): each "
                                "round synchronises the next fragment")
        if self.dp is not None and self.reducer.name != "mean":
            yield ("dp", "central DP needs reducer mean")
        if self.dp is not None and self.buffered:
            yield ("dp", "needs synchronous rounds (aggregation.mode: sync): the privacy "
                         "accountant assumes each round samples clients uniformly at random, "
                         "and a buffered version takes the updates that arrive first, so no "
                         "epsilon it reported would hold")
        try:
            why = make_reducer(self.reducer.name, self.reducer.params()).problem(self.quorum)
        except ValueError:  # its parameters are wrong: said above
            why = None
        if why:  # a round commits with as few as quorum updates: the rule must work there
            yield ("reducer", f"{self.reducer.name} {why}; min_clients is {self.quorum}")
        if self.local_steps is None and self.local_epochs is None:
            yield ("local_epochs", "set local_epochs or local_steps")
        if self.optimizer.schedule == "cosine" and self.optimizer.schedule_steps is None \
                and self.local_steps is None and self.time_budget_s is None:
            yield ("optimizer.schedule_steps", "a cosine schedule needs schedule_steps (or "
                                               "local_steps or time_budget_s, to derive it)")
        yield from _kwargs_problems("model_args", models[self.model], self.model_args,
                                    skip=2, owner=self.model)
        yield from _kwargs_problems("dataset_args", datasets[self.dataset], self.dataset_args,
                                    skip=1, owner=self.dataset)
        if self.data_dir is not None and self.dataset in READS_DATA_DIR \
                and not Path(self.data_dir).expanduser().is_dir():
            yield ("data_dir", f"folder {self.data_dir} does not exist")
        try:
            self.fixed_queue_counts()
        except ValueError as exc:
            field, _, msg = str(exc).partition(": ")
            yield (field, msg)
        yield from self._site_problems()

    def _site_problems(self) -> Iterator[tuple[str, str]]:
        """``sites`` places every client at exactly one site, by a name its queue can carry."""
        if self.sites is None:
            return
        if not self.sites:
            yield ("sites", "name at least one site and its clients")
            return
        bad = next((n for n in self.sites if re.fullmatch(SITE_NAME_PATTERN, n) is None), None)
        if bad is not None:
            yield ("sites", f"site name {bad[:40]!r}: 1-27 of a-z, 0-9, _ and -, starting "
                            f"with a letter or digit")
        seen: dict[int, str] = {}
        for site, clients in self.sites.items():
            for c in clients:
                if not 0 <= c < self.num_clients:
                    yield ("sites", f"{site}: client {c} out of range 0..{self.num_clients - 1}")
                    return
                if c in seen:
                    yield ("sites", f"client {c} is at two sites ({seen[c]} and {site})")
                    return
                seen[c] = site
        missing = sorted(set(range(self.num_clients)) - set(seen))
        if missing:
            yield ("sites", f"client {missing[0]} is at no site (every client must be at one; "
                            f"{len(missing)} are not)")
        if "queues" in _changed(self):
            yield ("queues", "not used with sites: each client's task goes to its site's queue")
        if self.clients_per_worker is not None:
            yield ("clients_per_worker", "not used with sites: a round prefers the clients "
                                         "of sites that can train now")

    def site_queue_of(self, client: int) -> str | None:
        """The queue of the site holding ``client``'s data (None: the job has no sites)."""
        if self.sites is None:
            return None
        return next(site_queue(n) for n, cs in self.sites.items() if client in cs)

    def _unused(self) -> Iterator[tuple[str, str]]:
        """(field, why) for each option set where it would do nothing: no option is
        ignored in silence (tests/test_options.py holds every option x mode)."""
        from fedq.data.datasets import READS_DATA_DIR

        agg, comp, opt = self.aggregation, self.compression, self.optimizer
        if not self.buffered:
            for name in sorted(_changed(agg) - {"mode"}):
                yield (f"aggregation.{name}", "only used by buffered jobs (aggregation.mode: "
                                              "buffered)")
        st = agg.staleness
        used = {"constant": set(), "polynomial": {"a"}, "hinge": {"a", "b"}}[st.kind]
        for name in sorted(_changed(st) - used - {"kind"}):
            yield (f"aggregation.staleness.{name}", f"not used by kind {st.kind}")
        if "chunk" in _changed(comp) and comp.codec in ("none", "fp16") \
                and comp.downlink == "none":
            yield ("compression.chunk", "only used by the int8 codecs (codec int8 or auto, "
                                        "or downlink int8)")
        if "slow_link_mbit" in _changed(comp) and comp.codec != "auto":
            yield ("compression.slow_link_mbit", "only used by codec auto")
        if "beta2" in _changed(opt) and opt.name == "sgd":
            yield ("optimizer.beta2", "not used by sgd (adam and adamw)")
        if "momentum" in _changed(opt) and opt.name != "sgd":
            yield ("optimizer.momentum", f"not used by {opt.name} (its beta_1 is 0.9)")
        if opt.schedule == "constant":
            for name in sorted(_changed(opt) & {"schedule_steps", "final_lr_fraction"}):
                yield (f"optimizer.{name}", "only used by schedule cosine")
        if self.data_dir is not None and self.dataset not in READS_DATA_DIR:
            yield ("data_dir", f"not used by dataset {self.dataset} (only by "
                               f"{', '.join(sorted(READS_DATA_DIR))})")
        weighted = _registries()[2][self.reducer.name].weighted
        if self.weight_by != "samples" and (self.dp is not None or not weighted):
            yield ("weight_by", "not used: " + ("DP weighs every update alike" if self.dp
                                                 else f"{self.reducer.name} is unweighted"))

    def _sizing_problems(self) -> Iterator[tuple[str, str]]:
        """``clients_per_worker`` changes how many clients a round takes, which only a
        synchronous round on one queue (or ``queues: auto``) without DP can follow."""
        if self.clients_per_worker is None:
            return
        if self.buffered:
            yield ("clients_per_worker", "sizes synchronous rounds; a buffered job keeps "
                                         "clients_per_round tasks in flight")
        elif self.dp is not None:
            yield ("clients_per_worker", "cannot be used with dp: the privacy accountant "
                                         "assumes clients_per_round clients every round")
        elif self.queues != "auto" and len([n for n in self.queues.values() if n]) > 1:
            yield ("clients_per_worker", "needs queues: auto or a single queue (a fixed "
                                         "split over queues fixes the round's size)")

    def round_size(self, available: int | None) -> int:
        """Clients in a round when ``available`` workers can train now (None: unknown):
        ``clients_per_worker`` per available worker, from the quorum (rounds wait for
        workers to come back rather than shrink below it) up to ``clients_per_round``."""
        if self.clients_per_worker is None or available is None:
            return self.clients_per_round
        return max(min(self.quorum, self.clients_per_round),
                   min(self.clients_per_round, available * self.clients_per_worker))

    @property
    def buffered(self) -> bool:
        return self.aggregation.mode == "buffered"

    @property
    def quorum(self) -> int:
        """Usable updates a round needs: min_clients, or min_fraction of the round; for
        a buffered job, one version's updates (aggregation.buffer)."""
        if self.buffered:
            return self.aggregation.buffer
        need = self.min_clients
        if self.min_fraction is not None:
            need = max(need, math.ceil(self.min_fraction * self.clients_per_round - 1e-9))
        return need

    def fixed_queue_counts(self) -> dict[str, int]:
        """The tasks per training queue a spec's ``queues`` mapping asks for (sums to
        clients_per_round); ValueError naming the mistake. ``queues: auto`` is planned
        from the live workers (fedq/coordinator/planning.py): {}."""
        if self.queues == "auto":
            return {}
        unknown = sorted(set(self.queues) - set(TRAINING_QUEUES))
        if unknown:
            raise ValueError(
                f"queues: unknown queue {unknown[0]!r} (known: {', '.join(TRAINING_QUEUES)})"
            )
        rest = [q for q, n in self.queues.items() if n == -1]
        if len(rest) > 1:
            raise ValueError("queues: only one queue may take the rest (-1)")
        if any(n < -1 for n in self.queues.values()):
            raise ValueError("queues: counts must be >= 0 (or -1 for the rest)")
        fixed = sum(n for n in self.queues.values() if n >= 0)
        counts = {q: n for q, n in self.queues.items() if n > 0}
        if rest:
            if fixed > self.clients_per_round:
                raise ValueError(
                    f"queues: {fixed} tasks exceed clients_per_round ({self.clients_per_round})"
                )
            if self.clients_per_round - fixed:
                counts[rest[0]] = self.clients_per_round - fixed
        elif fixed != self.clients_per_round:
            raise ValueError(
                f"queues: counts sum to {fixed}, but clients_per_round is {self.clients_per_round}"
            )
        return counts

    def to_json(self) -> dict[str, Any]:
        # ``sites`` came after message format 3: left out while unset, a spec is what a
        # worker of an earlier fedq speaking format 3 reads (its spec forbids new keys)
        return self.model_dump(mode="json", exclude={"sites"} if self.sites is None else None)

    @property
    def schedule_steps(self) -> int | None:
        """The inner lr schedule's horizon in steps per client."""
        o = self.optimizer
        return o.schedule_steps or (self.rounds * self.local_steps if self.local_steps else None)

    def schedule_window(self, round_: int) -> tuple[float, float] | None:
        """With a time budget, the part of the cosine that round ``round_`` covers: the
        schedule follows the job's clock (rounds x time_budget_s), not each client's step
        count, which a slow worker would leave at a high lr while the fast ones decay."""
        if self.time_budget_s is None or self.optimizer.schedule != "cosine":
            return None
        return round_window(round_, self.rounds)


def round_window(round_: int, rounds: int) -> tuple[float, float]:
    """The fractions of a schedule over ``rounds`` rounds that round ``round_`` (1-based)
    runs from and to; a round past the last stays at the end (lr_at clamps to 1)."""
    return (round_ - 1) / rounds, min(round_, rounds) / rounds

def _changed(model: BaseModel) -> set[str]:
    """The fields of ``model`` whose value is not their default (a spec written out
    whole, defaults included, sets nothing by that)."""
    return {name for name, field in type(model).model_fields.items()
            if getattr(model, name) != field.get_default(call_default_factory=True)}


def _did_you_mean(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _kwargs_problems(field: str, fn: Callable[..., Any], args: dict[str, Any], *, skip: int,
                     owner: str) -> Iterator[tuple[str, str]]:
    """Check ``args`` against ``fn``'s keyword parameters (after its first ``skip``):
    unknown names, and values whose type does not match the default's."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    known = {p.name: p for p in params}
    for name, value in args.items():
        if name not in known:
            names = list(known)
            yield (f"{field}.{name}", f"unknown argument of {owner}"
                   f"{_did_you_mean(name, names)} (known: {', '.join(names) or 'none'})")
            continue
        default = known[name].default
        if default is inspect.Parameter.empty or default is None:
            continue
        if not _same_kind(value, default):
            yield (f"{field}.{name}", f"expected {_kind(default)}, got {value!r}")


def _same_kind(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and \
            (isinstance(default, float) or float(value).is_integer())
    if isinstance(default, (tuple, list)):
        return isinstance(value, (tuple, list))
    return isinstance(value, type(default))


def _kind(default: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", tuple: "a list",
            list: "a list", str: "a string"}.get(type(default), type(default).__name__)
