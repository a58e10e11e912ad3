"""Who a worker is and what the coordinator sent: Ed25519 keys and signatures
(docs/security.md, "Identity").

Each party keeps its own private key, made on its own machine and never sent anywhere:
the coordinator's in ``FEDQ_KEYS_DIR/coordinator.key`` (the control worker and the
``fedq worker`` commands of the coordinator's host share it), a worker's in
``FEDQ_KEYS_DIR/worker.key``, written by ``fedq worker join`` beside ``worker.json``
(its name, the coordinator's public key, and the service URLs of its join bundle).

With ``FEDQ_IDENTITY=required`` on the coordinator:

- each training task carries an expiry and the coordinator's signature over its body
  and its task id (:func:`seal`); a joined worker refuses a task that is unsigned,
  expired, altered, or meant for another task id (:func:`check_sealed`);
- a joined worker signs each result, every field of it together with the task id it
  answers (:func:`sign_result`); the coordinator admits only results signed by an
  active registered worker (fedq/coordinator/intake.py) and records the signer;
- task ids carry a tag only the coordinator can compute (:func:`task_tag`), so a
  worker cannot name, and so cannot answer, a task it was not given.

Signatures cover :func:`canonical` bytes: JSON with sorted keys and no spaces. What is
signed travels as JSON, whose floats round-trip exactly in Python, so both sides
serialise the same bytes. The primitives are the ``cryptography`` package's Ed25519
and HMAC-SHA256; nothing here is hand-made cryptography.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from fedq.errors import ConfigError

COORDINATOR_KEY = "coordinator.key"
WORKER_KEY = "worker.key"
WORKER_FILE = "worker.json"
#: A registered worker's name: it appears in update rows, logs and Redis user names.
NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,47}")
#: Seconds a sealed task stays valid beyond its job's round timeout (clock skew).
EXPIRY_GRACE_S = 300


class Refused(ValueError):
    """A task or message whose signature does not hold: one line saying why."""


def canonical(fields: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: ``fields`` as JSON, keys sorted, no spaces."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def public_text(key: Ed25519PrivateKey) -> str:
    """A private key's public half as base64 text (its 32 raw bytes)."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def fingerprint(public: str) -> str:
    """A short name for a public key: the first 16 hex digits of its sha256."""
    return hashlib.sha256(public.encode()).hexdigest()[:16]


def sign(key: Ed25519PrivateKey, fields: Mapping[str, Any]) -> str:
    return base64.b64encode(key.sign(canonical(fields))).decode()


def verify(public: str, fields: Mapping[str, Any], signature: object) -> bool:
    """Whether ``signature`` is ``public``'s over ``fields`` (never raises)."""
    if not isinstance(signature, str) or len(signature) > 200:
        return False
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public, validate=True))
        key.verify(base64.b64decode(signature, validate=True), canonical(fields))
        return True
    except (InvalidSignature, ValueError, binascii.Error, TypeError):
        return False


def load_key(path: Path, create: bool = False) -> Ed25519PrivateKey:
    """The private key in ``path`` (PEM, PKCS#8), made there (mode 0600) when ``create``
    and it does not exist yet. Another process making it at the same moment wins, and
    this one reads that key."""
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no key there") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path}: not an Ed25519 private key")
    return key


# -- the coordinator's side ---------------------------------------------------------------


def coordinator_key(keys_dir: Path) -> Ed25519PrivateKey:
    """The coordinator's key, made on first use (``fedq worker add`` or the first
    sealed task)."""
    return load_key(keys_dir / COORDINATOR_KEY, create=True)


@lru_cache(maxsize=4)
def _coordinator(keys_dir: Path) -> tuple[Ed25519PrivateKey, bytes]:
    key = coordinator_key(keys_dir)
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                            serialization.NoEncryption())
    # the task-id tag key: derived from the private key, for this one purpose
    return key, hmac.new(raw, b"fedq task id tags v1", hashlib.sha256).digest()


def task_tag(base: str, keys: Path | None) -> str:
    """The suffix of task id ``base``: ``-`` and 16 hex digits of an HMAC only the
    coordinator can compute, with its keys in ``keys`` (None: FEDQ_IDENTITY is off,
    no suffix)."""
    if keys is None:
        return ""
    return "-" + hmac.new(_coordinator(keys)[1], base.encode(), hashlib.sha256).hexdigest()[:16]


def seal(body: dict[str, Any], task_id: str, ttl_s: float,
         keys: Path | None) -> dict[str, Any]:
    """``body`` with an expiry and the signature over it and ``task_id`` of the
    coordinator whose keys are in ``keys``; None (FEDQ_IDENTITY is off): unchanged."""
    if keys is None:
        return body
    sealed = {**body, "expires": int(time.time() + ttl_s + EXPIRY_GRACE_S)}
    sealed["sig"] = sign(_coordinator(keys)[0], {**sealed, "task_id": task_id})
    return sealed


def check_sealed(body: Any, task_id: str, coordinator: str,
                 now: float | None = None) -> dict[str, Any]:
    """``body`` without its seal, or :class:`Refused`: unsigned, altered (or signed by
    another key, or for another task id), or expired."""
    if not isinstance(body, dict) or "sig" not in body:
        raise Refused(f"refused task {task_id[:120]}: unsigned task (this worker joined a "
                      f"coordinator that signs its tasks)")
    fields = {k: v for k, v in body.items() if k != "sig"}
    if not verify(coordinator, {**fields, "task_id": task_id}, body["sig"]):
        raise Refused(f"refused task {task_id[:120]}: its signature does not verify "
                      f"(altered in transit, not from the coordinator this worker joined, "
                      f"or sealed for another task)")
    expires = fields.get("expires")
    if not isinstance(expires, int) or isinstance(expires, bool):
        raise Refused(f"refused task {task_id[:120]}: it carries no expiry")
    if (time.time() if now is None else now) > expires:
        raise Refused(f"refused task {task_id[:120]}: it expired "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(expires))}")
    fields.pop("expires")
    return fields


@dataclass(frozen=True)
class Registry:
    """The registered workers as the coordinator reads them (fedq/coordinator/enrol.py):
    active names with their public keys, and the revoked names (a result signed by one
    is rejected saying so)."""

    active: dict[str, str]
    revoked: frozenset[str]
    #: each active name's registered queues (those its broker user may take tasks
    #: from); None only where a registry is built by hand without them (tests of the
    #: signature alone): then no queue is checked
    queues: Mapping[str, frozenset[str]] | None = None


def result_problem(raw: Mapping[str, Any], signer: str | None, sig: str | None, worker: str,
                   task_id: str, registry: Registry,
                   queues: Collection[str] | None = None) -> str | None:
    """Why ``raw`` is not a result signed for task ``task_id`` by an active registered
    worker registered for one of ``queues`` (the queue the task was sent to; None: any),
    or None (training results: fedq/coordinator/intake.py; inference shards:
    fedq/inference/jobs.py; served batches: fedq/serve/results.py). A worker takes
    tasks only from its registered queues (its broker user's rules), so an answer from
    a worker not registered for the task's queue answers a task it was not given."""
    if signer is None or sig is None:
        return (f"unsigned result from {worker[:60]}: with FEDQ_IDENTITY=required only "
                f"registered workers' results count (fedq worker add / join)")
    if signer in registry.revoked:
        return f"signed by {signer}, which is revoked"
    public = registry.active.get(signer)
    if public is None:
        return f"signed by {signer[:64]!r}, which is not a registered worker"
    if not verify(public, result_fields(raw, task_id), sig):
        return (f"{signer}'s signature does not verify for task {task_id} "
                f"(altered, or signed for another task)")
    if queues is not None and registry.queues is not None:
        own = registry.queues.get(signer, frozenset())
        if not own & set(queues):
            return (f"signed by {signer}, registered for {','.join(sorted(own)) or 'no queue'}"
                    f", but the task was sent to {','.join(sorted(queues))[:80]}: a worker "
                    f"answers only tasks sent to it")
    return None


def result_fields(result: Mapping[str, Any], task_id: str) -> dict[str, Any]:
    """What a result's signature covers: every field but the signature, and the id
    of the task it answers."""
    return {**{k: v for k, v in result.items() if k != "sig"}, "task_id": task_id}


# -- a worker's side ----------------------------------------------------------------------


@dataclass(frozen=True)
class Joined:
    """What ``fedq worker join`` stored: this worker's name and key, the coordinator's
    public key, and the services of its bundle."""

    name: str
    key: Ed25519PrivateKey
    coordinator: str  # the coordinator's public key (base64)
    queues: tuple[str, ...]

    def sign_result(self, result: dict[str, Any], task_id: str) -> dict[str, Any]:
        """``result`` signed by this worker for task ``task_id``."""
        signed = {**result, "signer": self.name}
        try:
            signed["sig"] = sign(self.key, result_fields(signed, task_id))
        except ValueError:  # a non-finite float: unsigned, the coordinator rejects it
            return result
        return signed


    def sign_message(self, task: str, args: Sequence[Any]) -> dict[str, Any]:
        """The ``signed`` argument of a control message about this worker (``task``
        with ``args``): who signs, when, and the signature over the three."""
        at = int(time.time())
        return {"signer": self.name, "at": at,
                "sig": sign(self.key, message_fields(task, args, self.name, at))}


def message_fields(task: str, args: Sequence[Any], signer: str, at: int) -> dict[str, Any]:
    """What a control message's signature covers."""
    return {"task": task, "args": list(args), "signer": signer, "at": at}


def check_message(signed: Any, task: str, args: Sequence[Any], active: Mapping[str, str],
                  revoked: Collection[str], now: float | None = None) -> str:
    """The registered worker that signed control message ``task(*args)``; raises
    :class:`Refused` (one line) when ``signed`` is missing, malformed, by an unknown or
    revoked worker, more than EXPIRY_GRACE_S from now, or not over these arguments."""
    if not isinstance(signed, dict):
        raise Refused("unsigned: with FEDQ_IDENTITY=required a worker's control messages "
                      "are signed by a registered worker")
    signer, at, sig = signed.get("signer"), signed.get("at"), signed.get("sig")
    if not isinstance(signer, str) or NAME.fullmatch(signer) is None or \
            not isinstance(at, int) or isinstance(at, bool):
        raise Refused("malformed signature: signer and at are not a worker name and a time")
    if signer in revoked:
        raise Refused(f"signed by {signer}, which is revoked")
    public = active.get(signer)
    if public is None:
        raise Refused(f"signed by {signer!r}, which is not a registered worker")
    if abs((time.time() if now is None else now) - at) > EXPIRY_GRACE_S:
        raise Refused(f"signed by {signer} at {at}, more than {EXPIRY_GRACE_S} s from now "
                      "(replayed, or the clocks disagree)")
    try:
        fields = message_fields(task, args, signer, at)
        canonical(fields)
    except (TypeError, ValueError):
        raise Refused("malformed message: its arguments are not JSON") from None
    if not verify(public, fields, sig):
        raise Refused(f"{signer}'s signature does not verify for this {task} message "
                      "(altered, or signed for another)")
    return signer


def read_worker_file(keys_dir: Path) -> dict[str, Any] | None:
    """``worker.json`` of a joined worker, or None when this machine has not joined."""
    path = keys_dir / WORKER_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc}); run `fedq worker join` again") from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or \
            not isinstance(data.get("coordinator_key"), str):
        raise ConfigError(f"{path}: not a fedq worker file; run `fedq worker join` again")
    return data


@lru_cache(maxsize=4)
def joined(keys_dir: Path) -> Joined | None:
    """This machine's worker identity, or None when it has not joined a coordinator
    (then it neither checks task seals nor signs its results)."""
    data = read_worker_file(keys_dir)
    if data is None:
        return None
    return Joined(data["name"], load_key(keys_dir / WORKER_KEY), data["coordinator_key"],
                  tuple(data.get("queues") or ()))


def join_proof(key: Ed25519PrivateKey, name: str, token: str) -> dict[str, str]:
    """What a joining worker sends: its name, its public key, its one-time token, and
    its signature over the three (proving it holds the key it registers)."""
    public = public_text(key)
    return {"name": name, "public_key": public, "token": token,
            "sig": sign(key, {"name": name, "public_key": public, "token": token})}
