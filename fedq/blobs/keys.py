"""Deterministic blob keys: a re-run task overwrites its blob instead of adding one."""

from __future__ import annotations


def job_prefix(job: str) -> str:
    return f"jobs/{job}/"


def global_key(job: str, round_number: int) -> str:
    """The global model after ``round_number`` (0 = the initial model)."""
    return f"jobs/{job}/r{round_number:05d}/global.safetensors"


def update_key(job: str, round_number: int, client: int) -> str:
    """Client ``client``'s update in round ``round_number``."""
    return f"jobs/{job}/r{round_number:05d}/updates/c{client:06d}.safetensors"
