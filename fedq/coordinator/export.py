"""Writing a job's newest global model as a Hugging Face checkpoint (``fedq export``)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from fedq.coordinator.evaluation import here
from fedq.coordinator.generate import newest_global
from fedq.data import load_dataset
from fedq.errors import SpecError
from fedq.models import build_model
from fedq.process import PROCESS
from fedq.settings import Settings
from fedq.weights import loads

#: A tokenizer folder's files that travel with an exported model (what a tokenizer's
#: ``save_pretrained`` writes), so that AutoTokenizer loads it from the export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def export(settings: Settings, job_id: str, folder: Path, adapter: bool = False) -> int:
    """Write job ``job_id``'s newest committed model into ``folder`` (new, or empty) as
    ``save_pretrained`` does: LoRA adapters merged into the base, or with ``adapter``
    the PEFT adapter alone; the files of the job's tokenizer, when its data set has one
    of its own; and ``fedq.json`` (job, round, the model's digest). Written
    into a temporary folder beside it and renamed: nothing half-written is left.
    Returns the round exported. Raises SpecError for a job that is no
    ``hf_causal_lm`` job, or a folder that holds files already."""
    spec, ref, committed = newest_global(settings, job_id)
    spec = here(spec)  # its checkpoint and tokenizer on this machine
    if spec.model != "hf_causal_lm":
        raise SpecError(f"job {job_id} trains {spec.model}: only hf_causal_lm jobs export as "
                        f"a Hugging Face checkpoint")
    folder = folder.expanduser().absolute()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise SpecError(f"{folder} exists and is not an empty folder: name a new one")
    ds = load_dataset(spec.dataset, spec.data_dir, spec.dataset_args)
    model = build_model(spec.model, ds.input_shape, ds.num_classes, **spec.model_args)
    model.load_state_dict(loads(PROCESS.blobs(settings).get(ref), what=f"blob {ref.key}"))
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.fedq-export-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        try:
            model.save_pretrained(tmp, adapter=adapter)  # type: ignore[operator]
        except ValueError as exc:
            raise SpecError(f"job {job_id}: {exc}") from None
        tokenizer = getattr(ds.tokenizer, "name", "bytes")
        if tokenizer != "bytes":  # the job's tokenizer goes with its model
            for name in TOKENIZER_FILES:
                if (Path(tokenizer) / name).is_file():
                    shutil.copyfile(Path(tokenizer) / name, tmp / name)
        (tmp / "fedq.json").write_text(json.dumps(
            {"job": job_id, "round": committed, "model": ref.sha256,
             "tokens": "bytes: ids 0-255 are the text's UTF-8 bytes" if tokenizer == "bytes"
             else f"the tokenizer of {tokenizer} (copied here)",
             "form": "peft adapter" if adapter else "merged"}, indent=2) + "\n")
        if folder.exists():
            folder.rmdir()  # empty, checked above
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return committed
