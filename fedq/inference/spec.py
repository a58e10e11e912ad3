"""An inference job's spec (``kind: inference``), validated like a training spec: each
mistake on one line with the file, line and column."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedq.errors import SpecError
from fedq.spec.load import _error_lines, read_spec_file

OPS = ("classify", "score", "generate", "embed")
Queue = Literal["gpu_new", "gpu_sm61", "cpu"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSource(_Model):
    """Where the weights come from: a finished training job's final global model (its
    id, or ``latest``: the newest completed job that fits the inputs), a safetensors
    file with the registry model it fits, or ``hf``: a Hugging Face checkpoint folder
    (``config.json``, safetensors, ``tokenizer.json``, as ``save_pretrained`` or
    ``fedq export`` writes it) run as it is, through its own tokenizer (``dataset_args``
    may set ``block_size``, the window of score and embed)."""

    job: str | None = Field(default=None, max_length=32)
    weights: str | None = None
    hf: str | None = None
    name: str | None = None  # registry model (with ``weights``)
    dataset: str | None = None  # what fixes its input shape and classes (with ``weights``)
    args: dict[str, Any] = Field(default_factory=dict)
    dataset_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSource":
        if sum(x is not None for x in (self.job, self.weights, self.hf)) != 1:
            raise ValueError("give exactly one of model.job (a finished training job), "
                             "model.weights (a safetensors file) or model.hf (a Hugging Face "
                             "checkpoint folder)")
        if self.weights is not None and (self.name is None or self.dataset is None):
            raise ValueError("model.weights needs model.name (a registry model) and "
                             "model.dataset (its input shape and classes)")
        return self


class Inputs(_Model):
    """A split of a data set fedq knows (read on each worker, like training data), or a
    text file of prompts (one per line; ``.jsonl``: objects with a ``prompt``), sent to
    the workers as one blob."""

    dataset: str | None = None
    split: Literal["train", "test"] = "test"
    limit: int = Field(default=0, ge=0)
    prompts: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "Inputs":
        if (self.dataset is None) == (self.prompts is None):
            raise ValueError("give exactly one of inputs.dataset or inputs.prompts")
        return self


class Sampling(_Model):
    max_tokens: int = Field(default=32, ge=1, le=4096)
    temperature: float = Field(default=0.8, gt=0, le=10)
    top_k: int = Field(default=40, ge=0, le=1_000_000)  # 0: no cut
    seed: int = Field(default=0, ge=0, le=2**31 - 1)


class InferenceSpec(_Model):
    kind: Literal["inference"]
    name: str = Field(default="inference", max_length=100)
    model: ModelSource
    inputs: Inputs
    op: Literal["classify", "score", "generate", "embed"]
    generate: Sampling = Field(default_factory=Sampling)
    shard_size: int = Field(default=256, ge=1, le=1_000_000)
    batch_size: int = Field(default=64, ge=1, le=65_536)
    queues: list[Queue] = Field(default=["cpu"], min_length=1)
    # shards out per queue at once; unset: two per worker of the queue (one running,
    # one waiting in the broker: fedq/inference/jobs.py ``queue_limits``)
    in_flight: int | None = Field(default=None, ge=1, le=1000)
    shard_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    max_redispatch: int = Field(default=2, ge=0, le=100)
    # once no shard waits, a queue's free slot runs a second copy of the shard out
    # longest (fedq/inference/jobs.py ``_backups``); the first answer counts
    backups: bool = True

    @model_validator(mode="after")
    def _fits(self) -> "InferenceSpec":
        problems = []
        if self.op == "classify" and self.inputs.prompts is not None:
            problems.append("op: classify reads images: inputs.dataset, not inputs.prompts")
        if self.op in ("score", "generate", "embed") and self.inputs.dataset is not None:
            problems.append(f"op: {self.op} reads text: inputs.prompts, not inputs.dataset")
        if len(set(self.queues)) != len(self.queues):
            problems.append("queues: a queue is named twice")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def is_inference(data: Any) -> bool:
    return isinstance(data, dict) and data.get("kind") == "inference"


def parse_inference(data: Any, source: str = "spec",
                    positions: dict[tuple[str | int, ...], tuple[int, int]] | None = None
                    ) -> InferenceSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return InferenceSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError("\n".join(_error_lines(source, exc, positions or {}))) from None


def load_inference(path: str | Path) -> InferenceSpec:
    data, positions = read_spec_file(path)
    return parse_inference(data, str(path), positions)
