"""The small JSON messages that travel through the broker (never weights)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fedq.blobs.base import BlobRef
from fedq.wire import FEDQ_VERSION, MESSAGE_FORMAT, check_task, parse_result


@dataclass(frozen=True)
class StepRef:
    """The global model as an int8 step from the previous one (``compression:
    {downlink: int8}``, fedq/aggregate/downlink.py): the step blob and the sha256 of
    the previous global model's blob, which a worker must hold to use it."""

    blob: BlobRef
    base: str

    def to_json(self) -> dict[str, Any]:
        return {**self.blob.to_json(), "base": self.base}

    @classmethod
    def from_json(cls, data: Any) -> "StepRef | None":
        if not data:
            return None
        return cls(BlobRef.from_json(data), str(data["base"]))


@dataclass(frozen=True)
class TrainRef:
    """What a training task needs: its job's spec, its place, and the global model's ref.

    ``round``: the round it trains for (a buffered task: the model version it trains
    from, plus one); ``task``: a buffered job's task number (0 in synchronous rounds)."""

    job: str
    round: int
    client: int
    queue: str
    spec: dict[str, Any]
    model: BlobRef
    attempt: int = 1  # dispatch attempt of this round (re-dispatch after a deadline)
    gen: int = 0  # the round row's id: tells a resumed round from the one it replaced
    step: StepRef | None = None  # the model as a step from the previous one, if published
    task: int = 0  # a buffered job's task number (0: a synchronous round's task)
    # presigned URLs for its blobs ({"get": {key: url}, "put": {key: url}}), where the
    # workers hold no S3 key (FEDQ_PRESIGN_ENDPOINT; fedq/blobs/presigned.py)
    links: dict[str, dict[str, str]] | None = None

    @property
    def number(self) -> int:
        """What names this task's update and seeds its training: the task number in a
        buffered job, the round otherwise."""
        return self.task or self.round

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "round": self.round, "task": self.task, "client": self.client,
                "queue": self.queue, "spec": self.spec, "model": self.model.to_json(),
                "attempt": self.attempt, "gen": self.gen,
                "step": self.step.to_json() if self.step else None,
                "format": MESSAGE_FORMAT, **({"links": self.links} if self.links else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrainRef":
        """Parse a task: :class:`fedq.wire.FormatError` unless it has the shape fedq
        generates (checked before any field is used)."""
        check_task(data)
        return cls(job=str(data["job"]), round=int(data["round"]), client=int(data["client"]),
                   queue=str(data["queue"]), spec=dict(data["spec"]),
                   model=BlobRef.from_json(data["model"]), attempt=int(data.get("attempt", 1)),
                   gen=int(data.get("gen", 0)), step=StepRef.from_json(data.get("step")),
                   task=int(data.get("task", 0)), links=data.get("links"))


@dataclass(frozen=True)
class TrainStats:
    """How the training went on the worker, beyond what FedAvg needs."""

    seen: int = 0  # samples processed, counting repeats (the ``processed`` weight)
    train_seconds: float = 0.0  # the training loop alone (no download, upload)
    raw_bytes: int = 0  # float32 size of the delta before its codec
    stopped_by_budget: bool = False  # the time budget ended training before its steps did
    amp: str = "off"  # mixed precision used: bf16 | fp16 | off
    device: str = "cpu"  # cpu | cuda:N | mps
    gpu_peak_mb: float | None = None  # peak GPU memory torch allocated in the task
    gpu_util: float | None = None  # mean GPU utilisation (%) sampled during training
    tokens: int = 0  # language models: tokens processed (samples processed x context)
    started: float | None = None  # the task's start, Unix seconds on the worker's clock
    download_seconds: float = 0.0  # fetching the global model (0: this process kept it)
    upload_seconds: float = 0.0  # encoding and storing the update
    codec: str = ""  # the update's codec (``codec: auto`` picks it per worker)
    uplink_mbit: float | None = None  # the worker's uplink (Mbit/s): its last large upload
    yielded: bool = False  # a partial update: training stopped early for the machine's owner


#: Uploads smaller than this say more about latency than about a link's rate: the
#: uplink is measured (worker, ``fedq workers``) only from larger ones.
MEASURE_UPLINK_BYTES = 1 << 20


@dataclass(frozen=True)
class UpdateRef:
    """What a training task returns: status ok|error|yielded (stopped for the machine's
    owner with too little done to send: fedq/worker/owner.py), where its update lies,
    what it did."""

    status: str
    job: str
    round: int
    client: int
    queue: str
    worker: str
    key: str | None = None
    sha256: str | None = None
    samples: int = 0
    steps: int = 0
    loss: float | None = None
    seconds: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    error: str | None = None
    attempt: int = 1
    gen: int = 0
    stats: TrainStats = field(default_factory=TrainStats)
    format: int = MESSAGE_FORMAT  # the message format of the worker that sent it
    version: str = FEDQ_VERSION  # its fedq version
    task: int = 0  # a buffered job's task number (0: a synchronous round's update)
    signer: str | None = None  # the registered worker whose signature it carried

    @property
    def blob(self) -> BlobRef:
        assert self.key is not None and self.sha256 is not None
        return BlobRef(self.key, self.sha256, self.bytes_up)

    def to_json(self) -> dict[str, Any]:
        """The result as a worker sends it (``signer`` only when it signs:
        :meth:`fedq.identity.Joined.sign_result` adds it with the signature)."""
        data = asdict(self)
        if data["signer"] is None:
            del data["signer"]
        return data

    @classmethod
    def from_json(cls, data: Any) -> "UpdateRef":
        """A result as the worker wrote it, for code that trusts its source (a row this
        coordinator stored). Results from the wire go through
        :func:`fedq.coordinator.intake.admit`, which checks every field."""
        model = parse_result(data)
        fields = model.model_dump()
        fields["stats"] = TrainStats(**fields["stats"])
        del fields["sig"]
        return cls(**fields)
