"""A job's int8 downlink step (fedq/aggregate/downlink.py) as its row records it.

Apart from fedq/coordinator/pipeline.py, which computes the step: the modules that
only read or record it (and the CLI's read-only commands through them) import no
torch.
"""

from __future__ import annotations

from fedq.blobs import BlobRef
from fedq.db import Job
from fedq.protocol.training import StepRef


def step_of(job: Job) -> StepRef | None:
    """The job's global model as an int8 step from the previous one, if it has one."""
    if not (job.step_key and job.step_sha256 and job.step_base):
        return None
    return StepRef(BlobRef(job.step_key, job.step_sha256, job.step_size or 0), job.step_base)


def set_step(job: Job, step: StepRef | None) -> None:
    """Record (or clear) the step that goes with the job's new global model."""
    job.step_key = step.blob.key if step else None
    job.step_sha256 = step.blob.sha256 if step else None
    job.step_size = step.blob.size if step else None
    job.step_base = step.base if step else None
