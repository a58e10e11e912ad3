"""The job spec: its schema (fedq/spec/schema.py) and how a file is read and its
mistakes reported (fedq/spec/load.py). How a spec is shown is output code
(``describe``, fedq/cli/output.py); how a round's tasks are split over queues is the
coordinator's (fedq/coordinator/planning.py)."""

from fedq.data.partition import ByGroupPartition, DirichletPartition, IIDPartition
from fedq.errors import SpecError
from fedq.spec.load import load_spec, parse_spec
from fedq.spec.schema import (
    AggregationSpec,
    CompressionSpec,
    JobSpec,
    OptimizerSpec,
    ReducerSpec,
    ServerSpec,
    round_window,
)

__all__ = ["AggregationSpec", "ByGroupPartition", "CompressionSpec", "DirichletPartition",
           "IIDPartition", "JobSpec", "OptimizerSpec", "ReducerSpec", "ServerSpec",
           "SpecError", "load_spec", "parse_spec", "round_window"]
