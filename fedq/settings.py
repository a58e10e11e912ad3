"""fedq's settings, read once from ``FEDQ_*`` environment variables.

With no URLs set, everything lives under ``FEDQ_HOME`` (default ``./.fedq``):
a SQLite database, a local blob directory, Celery's ``filesystem://`` broker and
its ``file://`` result backend. Production sets the URLs; the code is the same.

Variables:

=========================  ==============================================================
FEDQ_HOME                  folder for the embedded default (default ``./.fedq``)
FEDQ_BROKER_URL            Celery broker: ``redis://``, ``amqp://``, ``filesystem://``
FEDQ_RESULT_BACKEND        Celery result backend: ``redis://``, ``file://...``
FEDQ_DATABASE_URL          SQLAlchemy URL: ``postgresql+psycopg://...``, ``sqlite:///...``
FEDQ_BLOB_URL              blob store: a path, ``file://``, ``redis://``, ``s3://bucket/prefix``
FEDQ_S3_ENDPOINT_URL       S3 endpoint for ``s3://`` blobs (MinIO); credentials from AWS_*
FEDQ_BLOB_CHUNK_MB         a blob larger than this many MiB (default 64) is stored as chunks
                           of this size and a manifest on Redis (at most 512), or uploaded
                           in parts of this size to S3 (at least 5): fedq/blobs/chunks.py
                           (``AWS_SECRET_ACCESS_KEY_FILE``: the secret read from a file)
FEDQ_BLOB_CHUNK_MB         a blob larger than this many MiB (default 64) is stored as chunks
                           of this size and a manifest on Redis (at most 512), or uploaded
                           in parts of this size to S3 (at least 5): fedq/blobs/chunks.py
FEDQ_BROKER_URL_FILE       a file holding FEDQ_BROKER_URL (a Docker secret; set one of the two)
FEDQ_RESULT_BACKEND_FILE   a file holding FEDQ_RESULT_BACKEND
FEDQ_DATABASE_URL_FILE     a file holding FEDQ_DATABASE_URL
FEDQ_DATA_DIR              where datasets such as CIFAR-10 are read (and downloaded to)
FEDQ_DATA_CACHE            where the text corpora are kept once fetched (default
                           ``$XDG_CACHE_HOME/fedq/data``; fedq/data/text.py)
FEDQ_TORCH_THREADS         torch intra-op threads in a worker (default: torch's own)
FEDQ_VISIBILITY_TIMEOUT    Redis/SQS visibility timeout in seconds (default 7200)
FEDQ_POLL_INTERVAL         filesystem broker poll and chord_unlock retry, seconds (default 0.1)
FEDQ_AMP                   ``auto`` (default): the faster, timed on a model's first batch,
                           of float32 and the GPU class's mixed precision (bf16 from
                           sm_80, fp16 on 7.x; fedq.worker.loop.measured_amp); ``off``:
                           float32 on every GPU (docs/inference.md measured bf16 at
                           0.69-0.82x of float32 for small models)
FEDQ_SLOWDOWN              >= 1: make this worker's training steps that many times slower
                           (emulates a slower machine in tests and benchmarks)
FEDQ_EMULATE_HARDWARE      a JSON hardware report used instead of probing (tests)
FEDQ_SKIP_HARDWARE_CHECK   1: let a worker consume a GPU queue without the startup check
FEDQ_WATCHDOG_INTERVAL     seconds between watchdog runs (celery beat; default 5)
FEDQ_HEARTBEAT_S           seconds between a training task's heartbeats (default 5)
FEDQ_WORKER_LOST_S         a started task whose heartbeat has not moved for this long is
                           lost and sent again (default 15; the deadline stays the backstop)
FEDQ_PRESENCE_S            seconds between an idle worker's "still here" messages, which
                           reopen a site whose worker was recorded lost once it is back
                           (a paused laptop woken; default 30, 0: never)
FEDQ_LOG_FORMAT            ``text`` (default) or ``json``: one JSON object per log line,
                           with the job, round, client, task, worker and queue
FEDQ_BLOB_CACHE            a folder the workers of one machine share: each global model
                           is downloaded once per machine, not once per worker
FEDQ_UPLINK_MBIT           this worker's uplink in Mbit/s, for ``codec: auto`` (default:
                           measured from its last upload of at least 1 MiB)
FEDQ_IDENTITY              ``off`` (default) or ``required``: the coordinator signs its tasks
                           and admits only results signed by a registered worker
                           (``fedq worker add`` / ``join``; docs/security.md)
FEDQ_SERVE_API_KEY         ``fedq serve``: the key every request must carry
                           (``Authorization: Bearer KEY``)
FEDQ_SERVE_API_KEY_FILE    a file holding FEDQ_SERVE_API_KEY
FEDQ_KEYS_DIR              where this machine's keys are (default ``FEDQ_HOME/keys``): the
                           coordinator's, or a joined worker's with its ``worker.json``,
                           whose service URLs are used where the variables are not set
FEDQ_RABBITMQ_API          RabbitMQ's management API, where ``fedq worker add`` makes a worker's
                           own broker user (default: the broker's host, port 15672, its
                           credentials; fedq/coordinator/rabbit.py)
FEDQ_RABBITMQ_API_FILE     a file holding FEDQ_RABBITMQ_API
FEDQ_PRESIGN_ENDPOINT      the S3 endpoint as workers reach it: each training task then
                           carries presigned URLs for its blobs, and workers need no S3
                           key (an ``s3://`` FEDQ_BLOB_URL; fedq/blobs/presigned.py)
FEDQ_IMAGE_TORCH           set by fedq's images: ``release`` (the class's pin) or
                           ``default_index`` (its ``default_index`` pin, PyPI's build)
FEDQ_IMAGE_CLASS           set by fedq's images: the hardware class whose torch pin
                           ``fedq doctor`` checks the image against
FEDQ_RUN_WHEN              when this worker trains: ``always`` (default), ``idle`` (no user
                           input for FEDQ_IDLE_AFTER_MIN), ``schedule`` (FEDQ_RUN_WINDOW)
FEDQ_IDLE_AFTER_MIN        minutes without input before an ``idle`` worker trains (default 5)
FEDQ_RUN_WINDOW            hours to train in, ``22:00-07:00`` (``HH:MM[:SS]``; over midnight)
FEDQ_RUN_DAYS              days to train on, ``mon-fri`` or ``sat,sun`` (default every day)
FEDQ_AC_ONLY               1: train on mains power only (a laptop on battery steps aside)
FEDQ_MAX_OTHER_CPU         step aside while other programs use more than this % of the CPU
FEDQ_MAX_OTHER_GPU         step aside while more than this many other processes use a GPU
FEDQ_RESUME_AFTER_S        conditions must hold this long before training resumes (default 10)
FEDQ_PARTIAL_MIN           a task stopped for the owner uploads what it did when it finished
                           at least this fraction of its steps (default 0.25), else yields
FEDQ_LEAVE_IN_MEMORY       1 (default): a task that yields keeps where it stopped in CPU
                           memory (one task a worker), and goes on from there when it
                           comes back to this worker; 0: it starts over
FEDQ_LEAVE_ON_DISK         1: that kept task is also written under FEDQ_HOME/kept/, so a
                           restarted worker goes on from it too (default 0)
FEDQ_GPU_MEMORY_FRACTION   the share of each GPU's memory fedq's torch may allocate
FEDQ_INPUT_DIR             where the idle probe reads input devices (default /dev/input)
FEDQ_POWER_SUPPLY_DIR      where the power probe reads (default /sys/class/power_supply)
=========================  ==============================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedq.errors import ConfigError
from fedq.redaction import remember

ENV_PREFIX = "FEDQ_"
DEFAULT_HOME = ".fedq"
DEFAULT_VISIBILITY_TIMEOUT = 7200
DEFAULT_POLL_INTERVAL = 0.1


class Settings(BaseModel):
    """Typed settings; build with :func:`load_settings` (or :func:`get_settings`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    home: Path = Field(description="folder for the embedded default")
    broker_url: str
    result_backend: str
    database_url: str
    blob_url: str
    s3_endpoint_url: str | None = None
    blob_chunk_mb: float = Field(default=64.0, gt=0, le=512)
    data_dir: Path
    torch_threads: int | None = Field(default=None, ge=1)
    visibility_timeout: int = Field(default=DEFAULT_VISIBILITY_TIMEOUT, ge=1)
    poll_interval: float = Field(default=DEFAULT_POLL_INTERVAL, gt=0)
    amp: Literal["auto", "off"] = "auto"
    slowdown: float = Field(default=1.0, ge=1)
    emulate_hardware: Path | None = None
    skip_hardware_check: bool = False
    watchdog_interval: float = Field(default=5.0, gt=0)
    heartbeat_s: float = Field(default=5.0, gt=0)
    worker_lost_s: float = Field(default=15.0, gt=0)
    presence_s: float = Field(default=30.0, ge=0)
    image_class: str | None = None
    image_torch: Literal["release", "default_index"] = "release"
    log_format: Literal["text", "json"] = "text"
    blob_cache: Path | None = None
    uplink_mbit: float | None = Field(default=None, gt=0)
    identity: Literal["off", "required"] = "off"
    serve_api_key: str | None = None
    keys_dir: Path = Path(DEFAULT_HOME) / "keys"
    joined_as: str | None = None  # the registered name of a joined worker (worker.json)
    presign_endpoint: str | None = None
    rabbitmq_api: str | None = None
    # the owner comes first (fedq/worker/owner.py; docs/owners.md)
    run_when: Literal["always", "idle", "schedule"] = "always"
    idle_after_min: float = Field(default=5.0, ge=0)
    run_window: str | None = None
    run_days: str | None = None
    ac_only: bool = False
    max_other_cpu: float | None = Field(default=None, ge=0, le=100)
    max_other_gpu: int | None = Field(default=None, ge=0)
    resume_after_s: float = Field(default=10.0, ge=0)
    partial_min: float = Field(default=0.25, ge=0, le=1)
    leave_in_memory: bool = True
    leave_on_disk: bool = False
    gpu_memory_fraction: float | None = Field(default=None, gt=0, le=1)
    input_dir: Path = Path("/dev/input")
    power_dir: Path = Path("/sys/class/power_supply")

    @property
    def blob_chunk_bytes(self) -> int:
        """FEDQ_BLOB_CHUNK_MB in bytes."""
        return max(1, int(self.blob_chunk_mb * 2**20))

    @property
    def embedded_broker(self) -> bool:
        return self.broker_url.startswith("filesystem://")

    @property
    def broker_folder(self) -> Path:
        return self.home / "broker"


_KNOWN = {
    "HOME", "BROKER_URL", "RESULT_BACKEND", "DATABASE_URL", "BLOB_URL", "S3_ENDPOINT_URL",
    "BLOB_CHUNK_MB", "DATA_DIR", "TORCH_THREADS", "VISIBILITY_TIMEOUT", "POLL_INTERVAL",
    "SLOWDOWN", "AMP",
    "EMULATE_HARDWARE", "SKIP_HARDWARE_CHECK", "WATCHDOG_INTERVAL",
    "IMAGE_CLASS", "IMAGE_TORCH", "LOG_FORMAT", "BLOB_CACHE", "UPLINK_MBIT", "HEARTBEAT_S",
    "WORKER_LOST_S", "IDENTITY", "KEYS_DIR", "PRESIGN_ENDPOINT", "RABBITMQ_API",
    "RUN_WHEN", "IDLE_AFTER_MIN", "RUN_WINDOW", "RUN_DAYS", "AC_ONLY", "MAX_OTHER_CPU",
    "MAX_OTHER_GPU", "RESUME_AFTER_S", "PARTIAL_MIN", "LEAVE_IN_MEMORY",
    "LEAVE_ON_DISK", "GPU_MEMORY_FRACTION", "INPUT_DIR", "POWER_SUPPLY_DIR", "PRESENCE_S",
    "BROKER_URL_FILE", "RESULT_BACKEND_FILE", "DATABASE_URL_FILE", "RABBITMQ_API_FILE",
    "SERVE_API_KEY", "SERVE_API_KEY_FILE", "DATA_CACHE",
}
#: Settings that carry a password: each may come from a file instead (``FEDQ_X_FILE``,
#: the convention of Docker's secrets), so that `docker inspect` shows no password.
_SECRET = ("BROKER_URL", "RESULT_BACKEND", "DATABASE_URL", "SERVE_API_KEY", "RABBITMQ_API")
#: Variables for fedq's own test suite and benchmarks, not settings of fedq.
_TEST_PREFIXES = ("FEDQ_TEST_", "FEDQ_BENCH_")
#: Variables of the compose file (docker/.env, which docs/deploy.md loads into the shell)
#: and of scripts/, read by them and not by fedq: never an unknown setting.
_NOT_SETTINGS = {"FEDQ_BIND", "FEDQ_DOCKER_HOME", "FEDQ_IMAGE_CACHE", "FEDQ_DEBIAN_MIRROR",
                 "FEDQ_VENV_CACHE", "FEDQ_WHEELHOUSE_PORT", "FEDQ_ENV_FILE", "FEDQ_PKI_DIR"}


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Read settings from ``env`` (default ``os.environ``).

    Raises :class:`ConfigError` naming the variable for a malformed or unknown
    ``FEDQ_*`` variable (a typo such as ``FEDQ_BROKER`` would otherwise silently
    fall back to the embedded default).
    """
    env = dict(os.environ if env is None else env)
    for name in env:
        if name.startswith(_TEST_PREFIXES) or name in _NOT_SETTINGS:
            continue
        if name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):] not in _KNOWN:
            known = ", ".join(sorted(ENV_PREFIX + k for k in _KNOWN))
            raise ConfigError(f"unknown setting {name} (known: {known})")

    secrets = {key: secret(env, ENV_PREFIX + key) for key in _SECRET}

    def get(key: str) -> str | None:
        if key in secrets:
            return secrets[key]
        value = env.get(ENV_PREFIX + key)
        return value if value not in (None, "") else None

    home = Path(get("HOME") or DEFAULT_HOME).expanduser().absolute()
    keys_dir = Path(get("KEYS_DIR") or home / "keys").expanduser().absolute()
    joined_as, joined = _joined(keys_dir)
    for key in ("BROKER_URL", "RESULT_BACKEND", "BLOB_URL", "S3_ENDPOINT_URL"):
        if get(key) is None and joined.get(key.lower()):
            secrets[key] = joined[key.lower()]  # a joined worker's bundle (fedq worker join)
    raw: dict[str, Any] = {
        "home": home,
        "broker_url": get("BROKER_URL") or "filesystem://",
        "result_backend": get("RESULT_BACKEND") or f"file://{home / 'results'}",
        "database_url": get("DATABASE_URL") or f"sqlite:///{home / 'fedq.db'}",
        "blob_url": get("BLOB_URL") or str(home / "blobs"),
        "s3_endpoint_url": get("S3_ENDPOINT_URL"),
        "blob_chunk_mb": get("BLOB_CHUNK_MB") or 64.0,
        "data_dir": Path(get("DATA_DIR") or home / "data").expanduser().absolute(),
        "torch_threads": get("TORCH_THREADS"),
        "visibility_timeout": get("VISIBILITY_TIMEOUT") or DEFAULT_VISIBILITY_TIMEOUT,
        "poll_interval": get("POLL_INTERVAL") or DEFAULT_POLL_INTERVAL,
        "amp": get("AMP") or "auto",
        "slowdown": get("SLOWDOWN") or 1.0,
        "emulate_hardware": get("EMULATE_HARDWARE"),
        "skip_hardware_check": get("SKIP_HARDWARE_CHECK") or False,
        "watchdog_interval": get("WATCHDOG_INTERVAL") or 5.0,
        "heartbeat_s": get("HEARTBEAT_S") or 5.0,
        "worker_lost_s": get("WORKER_LOST_S") or 15.0,
        "presence_s": 30.0 if get("PRESENCE_S") is None else get("PRESENCE_S"),
        "image_class": get("IMAGE_CLASS"),
        "image_torch": get("IMAGE_TORCH") or "release",
        "log_format": get("LOG_FORMAT") or "text",
        "blob_cache": get("BLOB_CACHE"),
        "uplink_mbit": get("UPLINK_MBIT"),
        "identity": get("IDENTITY") or "off",
        "serve_api_key": get("SERVE_API_KEY"),
        "keys_dir": keys_dir,
        "joined_as": joined_as,
        "presign_endpoint": get("PRESIGN_ENDPOINT"),
        "rabbitmq_api": get("RABBITMQ_API"),
        "run_when": get("RUN_WHEN") or "always",
        "idle_after_min": get("IDLE_AFTER_MIN") or 5.0,
        "run_window": get("RUN_WINDOW"),
        "run_days": get("RUN_DAYS"),
        "ac_only": get("AC_ONLY") or False,
        "max_other_cpu": get("MAX_OTHER_CPU"),
        "max_other_gpu": get("MAX_OTHER_GPU"),
        "resume_after_s": get("RESUME_AFTER_S") or 10.0,
        "partial_min": get("PARTIAL_MIN") or 0.25,
        "leave_in_memory": get("LEAVE_IN_MEMORY") or True,
        "leave_on_disk": get("LEAVE_ON_DISK") or False,
        "gpu_memory_fraction": get("GPU_MEMORY_FRACTION"),
        "input_dir": get("INPUT_DIR") or "/dev/input",
        "power_dir": get("POWER_SUPPLY_DIR") or "/sys/class/power_supply",
    }
    try:
        settings = Settings(**raw)
        remember([settings.broker_url, settings.result_backend, settings.database_url,
                  settings.blob_url, settings.s3_endpoint_url])
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]).upper()
        raise ConfigError(f"{ENV_PREFIX}{field}: {err['msg']}") from None
    _refuse_placeholders({**{ENV_PREFIX + k: v or "" for k, v in secrets.items()},
                          "AWS_SECRET_ACCESS_KEY": secret(env, "AWS_SECRET_ACCESS_KEY") or ""})
    return settings


def _joined(keys_dir: Path) -> tuple[str | None, dict[str, str]]:
    """A joined worker's name and the service URLs its ``worker.json`` holds (``fedq
    worker join`` wrote them from its bundle); (None, {}) when this machine has not
    joined."""
    from fedq.identity import read_worker_file

    data = read_worker_file(keys_dir)
    if data is None:
        return None, {}
    services = data.get("services")
    return data["name"], ({k: v for k, v in services.items() if isinstance(v, str)}
                          if isinstance(services, dict) else {})


def secret(env: Mapping[str, str], name: str) -> str | None:
    """The value of ``name``, or the contents of the file ``name_FILE`` names (without
    a trailing newline); None when neither is set. Both set, or an unreadable file,
    raise :class:`ConfigError` naming the variable."""
    value, path = env.get(name) or None, env.get(name + "_FILE") or None
    if value and path:
        raise ConfigError(f"{name} and {name}_FILE are both set; set one of them")
    if path is None:
        return value
    try:
        text = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise ConfigError(f"{name}_FILE: {path}: cannot read it ({reason})") from None
    if not text:
        raise ConfigError(f"{name}_FILE: {path}: the file is empty")
    return text


#: How a placeholder password begins (the examples in fedq's docs and older
#: docker/env.example files): a deployment still using one is refused.
PLACEHOLDER = "change-me"
_PLACEHOLDER_FIX = "anyone can read it; `bash scripts/env.sh` writes random ones (docs/deploy.md)"


def _refuse_placeholders(env: dict[str, str]) -> None:
    """Refuse a placeholder password (anyone who read the repository knows it), in one
    line naming where it is."""
    for name in ("BROKER_URL", "RESULT_BACKEND", "DATABASE_URL"):
        value = env.get(ENV_PREFIX + name) or ""
        try:
            password = urlsplit(value).password or ""
        except ValueError:
            password = ""
        if password.startswith(PLACEHOLDER):
            raise ConfigError(f"{ENV_PREFIX}{name}: its password is a placeholder "
                              f"({PLACEHOLDER}...); {_PLACEHOLDER_FIX}")
    if (env.get("AWS_SECRET_ACCESS_KEY") or "").startswith(PLACEHOLDER):
        raise ConfigError(f"AWS_SECRET_ACCESS_KEY is a placeholder ({PLACEHOLDER}...); "
                          f"{_PLACEHOLDER_FIX}")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read on first use. Their secrets (passwords in URLs,
    AWS_SECRET_ACCESS_KEY) are remembered for :func:`fedq.redaction.redact_text`."""
    settings = load_settings()
    remember([settings.broker_url, settings.result_backend, settings.database_url,
              settings.blob_url, settings.s3_endpoint_url,
              secret(os.environ, "AWS_SECRET_ACCESS_KEY")])
    return settings
