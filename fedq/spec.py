"""The job spec: what a person writes in ``job.yaml`` and ``fedq submit`` validates.

Unknown keys are refused, and every error names its field, e.g.
``job.yaml: partition.alpha: Input should be greater than 0``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedq.app import TRAINING_QUEUES
from fedq.errors import SpecError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IIDPartition(_Strict):
    """Each client gets an equal, uniformly random share of the training set."""

    kind: Literal["iid"] = "iid"


class DirichletPartition(_Strict):
    """Per class, shares drawn from Dirichlet(alpha): small alpha, skewed clients."""

    kind: Literal["dirichlet"]
    alpha: float = Field(gt=0)
    min_samples: int = Field(default=2, ge=1, description="each client gets at least this many")


Partition = Annotated[IIDPartition | DirichletPartition, Field(discriminator="kind")]


class OptimizerSpec(_Strict):
    """The client's local optimizer."""

    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(default=0.05, gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)


class ServerSpec(_Strict):
    """The server optimizer over the aggregated delta (fedq/aggregate/server.py).
    Unset options take the optimizer's defaults."""

    name: Literal["fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi", "diloco"] = "fedavg"
    lr: float | None = Field(default=None, gt=0)
    momentum: float | None = Field(default=None, ge=0, lt=1, description="or beta_1")
    beta2: float | None = Field(default=None, ge=0, lt=1)
    tau: float | None = Field(default=None, gt=0)


class ReducerSpec(_Strict):
    """How client updates are combined (fedq/aggregate/): a weighted mean, FedNova,
    or a robust reducer (unweighted)."""

    name: Literal["mean", "fednova", "median", "trimmed_mean", "krum", "multi_krum",
                  "bulyan"] = "mean"
    beta: float = Field(default=0.1, ge=0, lt=0.5, description="trimmed_mean: cut per side")
    f: int = Field(default=1, ge=0, description="krum/multi_krum/bulyan: Byzantine clients")
    m: int | None = Field(default=None, ge=1, description="multi_krum: updates averaged")


class DPSpec(_Strict):
    """Central differential privacy: clip each update, add Gaussian noise to the mean."""

    noise_multiplier: float = Field(ge=0)
    clip_norm: float = Field(gt=0)
    delta: float = Field(default=1e-5, gt=0, lt=1)


class CompressionSpec(_Strict):
    """How clients encode their updates (fedq/aggregate/compression.py)."""

    codec: Literal["none", "fp16", "int8"] = "none"
    zstd: bool = False
    chunk: int = Field(default=256, ge=8, description="int8: elements per scale")


class ByzantineSpec(_Strict):
    """Robustness experiments only: these clients multiply their honest update by scale
    (scale -10: a sign flip, ten times as large)."""

    clients: list[int] = Field(min_length=1)
    scale: float = -10.0


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
    time_budget_s: float | None = Field(
        default=None, gt=0, description="each task stops training after this many seconds")
    weight_by: Literal["samples", "processed"] = Field(
        default="samples", description="FedAvg weight: shard size, or samples processed")
    server: ServerSpec = Field(default_factory=ServerSpec)
    reducer: ReducerSpec = Field(default_factory=ReducerSpec)
    clip_norm: float | None = Field(default=None, gt=0, description="clip each update's L2 norm")
    dp: DPSpec | None = None
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    byzantine: ByzantineSpec | None = None
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
    seed: int = Field(default=0, ge=0)
    keep_updates: int | None = Field(
        default=None, ge=0, description="keep the update blobs of this many latest rounds "
                                        "(0: delete each round's updates once it commits); "
                                        "unset: keep all. Global models are always kept")
    eval_every: int = Field(
        default=1, ge=0, description="evaluate the global model on the test split every N "
                                     "rounds and after the last; 0: never")
    zero_compute: bool = Field(
        default=False, description="benchmarks: clients skip training and send a small fixed "
                                   "change of every weight (the round machinery alone)")

    @model_validator(mode="after")
    def _check(self) -> "JobSpec":
        if self.clients_per_round > self.num_clients:
            raise ValueError(
                f"clients_per_round ({self.clients_per_round}) exceeds num_clients "
                f"({self.num_clients})"
            )
        if self.quorum > self.clients_per_round:
            raise ValueError(
                f"min_clients ({self.quorum}) exceeds clients_per_round "
                f"({self.clients_per_round})"
            )
        self._check_reducer()
        if self.byzantine and max(self.byzantine.clients) >= self.num_clients:
            raise ValueError(f"byzantine.clients: client {max(self.byzantine.clients)} "
                             f"out of range 0..{self.num_clients - 1}")
        if self.local_steps is not None:
            object.__setattr__(self, "local_epochs", None)
        elif self.local_epochs is None:
            raise ValueError("set local_epochs or local_steps")
        self.queue_counts()  # raises on a bad mix
        return self

    def _check_reducer(self) -> None:
        r, n = self.reducer, self.quorum
        if self.dp is not None and r.name != "mean":
            raise ValueError("dp: central DP needs reducer mean")
        if r.name in ("krum", "multi_krum") and n <= r.f + 2:
            raise ValueError(f"reducer.f: {r.name} needs min_clients > f + 2 "
                             f"(min_clients {n}, f {r.f})")
        if r.name == "bulyan" and n < 4 * r.f + 3:
            raise ValueError(f"reducer.f: bulyan needs min_clients >= 4f + 3 "
                             f"(min_clients {n}, f {r.f})")
        if r.name == "multi_krum" and r.m is not None and r.m > n - r.f:
            raise ValueError(f"reducer.m: {r.m} exceeds min_clients - f ({n - r.f})")

    @property
    def quorum(self) -> int:
        """Usable updates a round needs: min_clients, or min_fraction of the round."""
        need = self.min_clients
        if self.min_fraction is not None:
            need = max(need, math.ceil(self.min_fraction * self.clients_per_round - 1e-9))
        return need

    def queue_counts(self, live_throughput: dict[str, float] | None = None) -> dict[str, int]:
        """How many tasks go to each training queue per round (sums to clients_per_round).

        With ``queues: auto`` the split follows ``live_throughput`` (queue -> summed
        samples/s of its live workers); with none known, every task goes to ``cpu``."""
        if self.queues == "auto":
            return split_by_throughput(self.clients_per_round, live_throughput or {})
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
        return self.model_dump(mode="json")


def describe(spec: JobSpec) -> str:
    """One line naming the strategy, for `fedq results`."""
    parts = [f"server {spec.server.name}", f"reducer {spec.reducer.name}"]
    if spec.reducer.name == "trimmed_mean":
        parts[-1] += f" (beta {spec.reducer.beta})"
    elif spec.reducer.name in ("krum", "multi_krum", "bulyan"):
        parts[-1] += f" (f {spec.reducer.f})"
    if spec.clip_norm:
        parts.append(f"clip {spec.clip_norm}")
    if spec.dp:
        parts.append(f"DP z={spec.dp.noise_multiplier} C={spec.dp.clip_norm} "
                     f"delta={spec.dp.delta}")
    codec = spec.compression.codec + ("+zstd" if spec.compression.zstd else "")
    parts.append(f"updates {codec}")
    if spec.prox_mu:
        parts.append(f"FedProx mu {spec.prox_mu}")
    if spec.byzantine:
        parts.append(f"byzantine clients {spec.byzantine.clients} x{spec.byzantine.scale}")
    return ", ".join(parts)


def split_by_throughput(tasks: int, throughput: dict[str, float]) -> dict[str, int]:
    """Largest-remainder split of ``tasks`` across training queues in proportion to their
    throughput; queues in TRAINING_QUEUES order break ties. Pure, for tests."""
    usable = {q: throughput[q] for q in TRAINING_QUEUES if throughput.get(q, 0) > 0}
    if not usable:
        return {"cpu": tasks}
    total = sum(usable.values())
    exact = {q: tasks * v / total for q, v in usable.items()}
    counts = {q: int(e) for q, e in exact.items()}
    by_remainder = sorted(usable, key=lambda q: (-(exact[q] - counts[q]),
                                                 TRAINING_QUEUES.index(q)))
    for q in by_remainder[:tasks - sum(counts.values())]:
        counts[q] += 1
    return {q: n for q, n in counts.items() if n > 0}


def _format_error(source: str, exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if p not in ("iid", "dirichlet"))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    return f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}"


def parse_spec(data: Any, source: str = "spec") -> JobSpec:
    """Validate a mapping as a :class:`JobSpec`; raise :class:`SpecError` naming the field."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_format_error(source, exc)) from None
    from fedq.data import check_dataset
    from fedq.models import check_model

    check_model(spec.model, source)
    check_dataset(spec, source)
    return spec


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML or JSON job spec file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                        f"{first}") from None
    return parse_spec(data, str(path))
