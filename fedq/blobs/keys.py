"""Deterministic blob keys: a re-run task overwrites its blob instead of adding one."""

from __future__ import annotations


def job_prefix(job: str) -> str:
    return f"jobs/{job}/"


def global_key(job: str, round_number: int, tag: str = "") -> str:
    """The global model after ``round_number`` (0 = the initial model). ``tag``: a
    buffered job's version is written under a key of its own per attempt to make it,
    so a losing attempt never overwrites the blob the committed one points at."""
    return f"jobs/{job}/r{round_number:05d}/global{'-' + tag if tag else ''}.safetensors"


def step_key(job: str, round_number: int, tag: str = "") -> str:
    """The global model after ``round_number`` as an int8 step from the one before."""
    return f"jobs/{job}/r{round_number:05d}/step{'-' + tag if tag else ''}.safetensors"


def state_key(job: str, round_number: int, tag: str = "") -> str:
    """The server optimizer's state after ``round_number``."""
    return f"jobs/{job}/r{round_number:05d}/server-state{'-' + tag if tag else ''}.safetensors"


def update_key(job: str, round_number: int, client: int, attempt: int = 1,
               worker: str | None = None) -> str:
    """Client ``client``'s update in round ``round_number``, dispatch ``attempt``;
    under ``updates/WORKER/`` when a registered worker made it (its Redis user may
    write there only: fedq/coordinator/acl.py).

    The attempt is in the key so that a straggler from attempt 1 finishing after the
    re-dispatched attempt 2 cannot overwrite the blob attempt 2's ref points at."""
    folder = f"{worker}/" if worker else ""
    return f"jobs/{job}/r{round_number:05d}/updates/{folder}c{client:06d}-a{attempt}.safetensors"


def updates_prefix(job: str, round_number: int) -> str:
    """Every update blob of round ``round_number``."""
    return f"jobs/{job}/r{round_number:05d}/updates/"
