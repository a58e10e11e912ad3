"""Sampling text from a job's latest global model (``fedq generate``)."""

from __future__ import annotations

import torch

from fedq.blobs import BlobRef
from fedq.coordinator.jobs import get_job
from fedq.data import load_dataset
from fedq.data.tokens import ByteTokenizer
from fedq.db import Job, session_scope
from fedq.errors import SpecError
from fedq.models import build_model
from fedq.process import PROCESS
from fedq.settings import Settings
from fedq.spec import JobSpec
from fedq.weights import loads


def newest_global(settings: Settings, job_id: str) -> tuple[JobSpec, BlobRef, int]:
    """Job ``job_id``'s spec, its newest committed global model and that round's number;
    JobNotFound for an unknown job."""
    get_job(settings, job_id)
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        return (JobSpec.model_validate(job.spec),
                BlobRef(job.global_key, job.global_sha256, job.global_size),
                job.committed_round)


def generate(settings: Settings, job_id: str, prompt: str, tokens: int, *,
             temperature: float = 0.8, top_k: int | None = 40, seed: int = 0) -> str:
    """``prompt`` followed by ``tokens`` tokens (of the job's data set's tokenizer)
    sampled from the job's newest committed model (temperature, then top-k). Raises
    SpecError for a model that is no language model, JobNotFound for an unknown job."""
    spec, ref, _ = newest_global(settings, job_id)
    ds = load_dataset(spec.dataset, spec.data_dir, spec.dataset_args)
    if not ds.is_text:
        raise SpecError(f"job {job_id} trains {spec.model} on {spec.dataset}, not a language "
                        "model: nothing to generate")
    model = build_model(spec.model, ds.input_shape, ds.num_classes, **spec.model_args)
    store = PROCESS.blobs(settings)
    model.load_state_dict(loads(store.get(ref), what=f"blob {ref.key}"))
    model.eval()
    tok = ds.tokenizer or ByteTokenizer()
    start = torch.tensor(tok.encode(prompt or "\n") or [0], dtype=torch.int64)
    new = model.generate_batch(  # type: ignore[operator]
        [start], tokens, temperature=temperature, top_k=top_k,  # with its key-value cache
        generators=[torch.Generator().manual_seed(seed)])[0]
    return tok.decode(torch.cat([start, new]).tolist())
