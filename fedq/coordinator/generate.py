"""Sampling text from a job's latest global model (``fedq generate``)."""

from __future__ import annotations

from pathlib import Path

import torch

from fedq.blobs import BlobRef
from fedq.coordinator.evaluation import here
from fedq.coordinator.jobs import get_job
from fedq.data import load_dataset
from fedq.data.tokens import ByteTokenizer, FolderTokenizer, chat_prompt
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
             temperature: float = 0.8, top_k: int | None = 40, seed: int = 0,
             chat: str | None = None) -> str:
    """``prompt`` followed by ``tokens`` tokens (of the job's data set's tokenizer)
    sampled from the job's newest committed model (temperature, then top-k). With
    ``chat``: the model's reply to that user message, rendered by the tokenizer
    folder's chat template, up to its end-of-turn text (the reply alone). Raises
    SpecError for a model that is no language model, or ``chat`` without a tokenizer
    folder; DataUnavailable for one without a chat template; JobNotFound for an
    unknown job."""
    spec, ref, _ = newest_global(settings, job_id)
    spec = here(spec)  # its checkpoint and tokenizer on this machine
    ds = load_dataset(spec.dataset, spec.data_dir, spec.dataset_args)
    if not ds.is_text:
        raise SpecError(f"job {job_id} trains {spec.model} on {spec.dataset}, not a language "
                        "model: nothing to generate")
    model = build_model(spec.model, ds.input_shape, ds.num_classes, **spec.model_args)
    store = PROCESS.blobs(settings)
    model.load_state_dict(loads(store.get(ref), what=f"blob {ref.key}"))
    model.eval()
    tok = ds.tokenizer or ByteTokenizer()
    end = None
    if chat is not None:
        if not isinstance(tok, FolderTokenizer):
            raise SpecError(f"job {job_id}: --chat needs a model trained through a "
                            "tokenizer folder with a chat template (dataset_args.tokenizer); "
                            "this job's tokenizer is bytes")
        folder = spec.dataset_args.get("tokenizer")
        prompt, end = chat_prompt(str(folder), Path(spec.data_dir) if spec.data_dir else None,
                                  chat)
    start = torch.tensor(tok.encode(prompt or "\n") or [0], dtype=torch.int64)
    new = model.generate_batch(  # type: ignore[operator]
        [start], tokens, temperature=temperature, top_k=top_k,  # with its key-value cache
        generators=[torch.Generator().manual_seed(seed)])[0]
    if chat is None:
        return tok.decode(torch.cat([start, new]).tolist())
    reply = tok.decode(new.tolist())
    return reply.split(end, 1)[0] if end else reply
