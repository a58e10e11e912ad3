"""fedq's settings, read once from ``FEDQ_*`` environment variables.

With no URLs set, everything lives under ``FEDQ_HOME`` (default ``./.fedq``):
a SQLite database, a local blob directory, Celery's ``filesystem://`` broker and
its ``file://`` result backend. Production sets the URLs; the code is the same.

Each setting is declared once, as a field of :class:`Settings`: its type, default,
bounds and one description. The variable is ``FEDQ_`` and the field's name in capitals
unless the field names another; a setting that carries a password may come from a file
instead (``FEDQ_X_FILE``). docs/settings.md is generated from these declarations
(``.venv/bin/python -m fedq.settings > docs/settings.md``; tests/test_environment.py
checks that it matches).
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


def setting(default: Any = ..., doc: str = "", *, env: str | None = "",
            secret: bool = False, shown: str | None = None, **bounds: Any) -> Any:
    """One setting's declaration: ``default`` (``...``: derived from FEDQ_HOME when
    unset, see ``_DERIVED``), its description, its variable (``""``: ``FEDQ_`` + the
    field's name in capitals; None: not read from the environment), whether it may come
    from a file (``secret``), the default as docs/settings.md shows it, and pydantic's
    bounds (``ge``, ``gt``, ``le``)."""
    return Field(default=default, description=doc,
                 json_schema_extra={"env": env, "secret": secret, "shown": shown}, **bounds)


class Settings(BaseModel):
    """Typed settings; build with :func:`load_settings` (or :func:`get_settings`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    home: Path = setting(doc="folder for the embedded default", shown="./.fedq")
    broker_url: str = setting(
        doc="Celery broker: ``redis://``, ``amqp://``, ``filesystem://``", secret=True,
        shown="filesystem:// under FEDQ_HOME")
    result_backend: str = setting(
        doc="Celery result backend: ``redis://``, ``file://...``", secret=True,
        shown="file://FEDQ_HOME/results")
    database_url: str = setting(
        doc="SQLAlchemy URL: ``postgresql+psycopg://...``, ``sqlite:///...``", secret=True,
        shown="sqlite:///FEDQ_HOME/fedq.db")
    blob_url: str = setting(
        doc="blob store: a path, ``file://``, ``redis://``, ``s3://bucket/prefix``",
        shown="FEDQ_HOME/blobs")
    s3_endpoint_url: str | None = setting(
        None, "S3 endpoint for ``s3://`` blobs (MinIO); credentials from AWS_* "
        "(``AWS_SECRET_ACCESS_KEY_FILE``: the secret read from a file)")
    blob_chunk_mb: float = setting(
        64.0, "a blob larger than this many MiB is stored as chunks of this size and a "
        "manifest on Redis (at most 512), or uploaded in parts of this size to S3 (at "
        "least 5): fedq/blobs/chunks.py", gt=0, le=512)
    data_dir: Path = setting(
        doc="where datasets such as CIFAR-10 are read (and downloaded to)",
        shown="FEDQ_HOME/data")
    data_cache: Path | None = setting(
        None, "where the text corpora are kept once fetched (unset: "
        "``$XDG_CACHE_HOME/fedq/data``; fedq/data/text.py)")
    torch_threads: int | None = setting(
        None, "torch intra-op threads in a worker (unset: torch's own)", ge=1)
    visibility_timeout: int = setting(
        DEFAULT_VISIBILITY_TIMEOUT, "Redis/SQS visibility timeout in seconds", ge=1)
    poll_interval: float = setting(
        DEFAULT_POLL_INTERVAL, "filesystem broker poll and chord_unlock retry, seconds", gt=0)
    amp: Literal["auto", "off"] = setting(
        "auto", "``auto``: the faster, timed on a model's first batch, of float32 and the "
        "GPU class's mixed precision (bf16 from sm_80, fp16 on 7.x; "
        "fedq.worker.loop.measured_amp); ``off``: float32 on every GPU")
    emulate_hardware: Path | None = setting(
        None, "a JSON hardware report used instead of probing (tests)")
    skip_hardware_check: bool = setting(
        False, "1: let a worker consume a GPU queue without the startup check")
    watchdog_interval: float = setting(
        5.0, "seconds between watchdog runs (celery beat)", gt=0)
    heartbeat_s: float = setting(5.0, "seconds between a training task's heartbeats", gt=0)
    worker_lost_s: float = setting(
        15.0, "a started task whose heartbeat has not moved for this long is lost and sent "
        "again (the deadline stays the backstop)", gt=0)
    presence_s: float = setting(
        30.0, "seconds between an idle worker's \"still here\" messages, which reopen a "
        "site whose worker was recorded lost once it is back (a paused laptop woken; 0: "
        "never)", ge=0)
    image_class: str | None = setting(
        None, "set by fedq's images: the hardware class whose torch pin ``fedq doctor`` "
        "checks the image against")
    image_torch: Literal["release", "default_index"] = setting(
        "release", "set by fedq's images: ``release`` (the class's pin) or "
        "``default_index`` (its ``default_index`` pin, PyPI's build)")
    log_format: Literal["text", "json"] = setting(
        "text", "``text`` or ``json``: one JSON object per log line, with the job, round, "
        "client, task, worker and queue")
    blob_cache: Path | None = setting(
        None, "a folder the workers of one machine share: each global model is "
        "downloaded once per machine, not once per worker")
    uplink_mbit: float | None = setting(
        None, "this worker's uplink in Mbit/s, for ``codec: auto`` (unset: measured from "
        "its last upload of at least 1 MiB)", gt=0)
    identity: Literal["off", "required"] = setting(
        "off", "``off`` or ``required``: the coordinator signs its tasks and admits only "
        "results signed by a registered worker (``fedq worker add`` / ``join``; "
        "docs/security.md)")
    serve_api_key: str | None = setting(
        None, "``fedq serve``: the key every request must carry "
        "(``Authorization: Bearer KEY``)", secret=True)
    keys_dir: Path = setting(
        doc="where this machine's keys are: the coordinator's, or a joined worker's with "
        "its ``worker.json``, whose service URLs are used where the variables are not set",
        shown="FEDQ_HOME/keys")
    joined_as: str | None = setting(
        None, "the registered name of a joined worker (its worker.json)", env=None)
    presign_endpoint: str | None = setting(
        None, "the S3 endpoint as workers reach it: each training task then carries "
        "presigned URLs for its blobs, and workers need no S3 key (an ``s3://`` "
        "FEDQ_BLOB_URL; fedq/blobs/presigned.py)")
    rabbitmq_api: str | None = setting(
        None, "RabbitMQ's management API, where ``fedq worker add`` makes a worker's own "
        "broker user (unset: the broker's host, port 15672, its credentials; "
        "fedq/coordinator/rabbit.py)", secret=True)
    # the owner comes first (fedq/worker/owner.py; docs/owners.md)
    run_when: Literal["always", "idle", "schedule"] = setting(
        "always", "when this worker trains: ``always``, ``idle`` (no user input for "
        "FEDQ_IDLE_AFTER_MIN), ``schedule`` (FEDQ_RUN_WINDOW)")
    idle_after_min: float = setting(
        5.0, "minutes without input before an ``idle`` worker trains", ge=0)
    run_window: str | None = setting(
        None, "hours to train in, ``22:00-07:00`` (``HH:MM[:SS]``; over midnight)")
    run_days: str | None = setting(
        None, "days to train on, ``mon-fri`` or ``sat,sun`` (unset: every day)")
    ac_only: bool = setting(
        False, "1: train on mains power only (a laptop on battery steps aside)")
    max_other_cpu: float | None = setting(
        None, "step aside while other programs use more than this % of the CPU", ge=0, le=100)
    max_other_gpu: int | None = setting(
        None, "step aside while more than this many other processes use a GPU", ge=0)
    resume_after_s: float = setting(
        10.0, "conditions must hold this long before training resumes", ge=0)
    partial_min: float = setting(
        0.25, "a task stopped for the owner uploads what it did when it finished at least "
        "this fraction of its steps, else yields", ge=0, le=1)
    leave_in_memory: bool = setting(
        True, "1: a task that yields keeps where it stopped in CPU memory (one task a "
        "worker), and goes on from there when it comes back to this worker; 0: it starts "
        "over")
    leave_on_disk: bool = setting(
        False, "1: that kept task is also written under FEDQ_HOME/kept/, so a restarted "
        "worker goes on from it too")
    gpu_memory_fraction: float | None = setting(
        None, "the share of each GPU's memory fedq's torch may allocate", gt=0, le=1)
    devices: str | None = setting(
        None, "the devices one training task runs on, data-parallel (fedq/worker/ranks.py): "
        "all (every GPU), a count (the first N GPUs; N processes on a machine without a "
        "GPU) or GPU indices such as 0,1,2,3; unset: one")
    train_memory_mb: float | None = setting(
        None, "the most MB a training task's weights, gradients and optimizer state may "
        "take on this worker's device; a task over it (or over the device's free memory) "
        "is refused before its first step (fedq/worker/fit.py)", gt=0)
    control_memory_mb: float | None = setting(
        None, "the most MB the control worker may hold while it aggregates; fedq submit "
        "refuses a job whose model would need more (fedq/coordinator/capacity.py)", gt=0)
    input_dir: Path = setting(Path("/dev/input"), "where the idle probe reads input devices")
    power_dir: Path = setting(Path("/sys/class/power_supply"),
                              "where the power probe reads", env="POWER_SUPPLY_DIR")

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


def _extra(name: str) -> dict[str, Any]:
    extra = Settings.model_fields[name].json_schema_extra
    return extra if isinstance(extra, dict) else {}


#: Each setting's variable, less its ``FEDQ_`` prefix, by field name.
ENV: dict[str, str] = {
    name: str(_extra(name).get("env") or name.upper())
    for name in Settings.model_fields if _extra(name).get("env", "") is not None}
#: Settings that carry a password: each may come from a file instead (``FEDQ_X_FILE``,
#: the convention of Docker's secrets), so that `docker inspect` shows no password.
_SECRET = tuple(ENV[name] for name in ENV if _extra(name).get("secret"))
_KNOWN = set(ENV.values()) | {f"{key}_FILE" for key in _SECRET}
#: Defaults made from FEDQ_HOME (absolute).
_DERIVED: dict[str, Any] = {
    "broker_url": lambda home: "filesystem://",
    "result_backend": lambda home: f"file://{home / 'results'}",
    "database_url": lambda home: f"sqlite:///{home / 'fedq.db'}",
    "blob_url": lambda home: str(home / "blobs"),
    "data_dir": lambda home: home / "data",
    "keys_dir": lambda home: home / "keys",
}
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
    raw: dict[str, Any] = {name: value for name, key in ENV.items()
                           if (value := get(key)) is not None}
    for name, default in _DERIVED.items():
        raw.setdefault(name, default(home))
    raw.update(home=home, keys_dir=keys_dir, joined_as=joined_as,
               data_dir=Path(raw["data_dir"]).expanduser().absolute())
    try:
        settings = Settings(**raw)
        remember([settings.broker_url, settings.result_backend, settings.database_url,
                  settings.blob_url, settings.s3_endpoint_url])
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0])
        raise ConfigError(f"{ENV_PREFIX}{ENV.get(field, field.upper())}: {err['msg']}") \
            from None
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


def _shown(name: str) -> str:
    """A setting's default as docs/settings.md shows it."""
    field = Settings.model_fields[name]
    shown = _extra(name).get("shown")
    if shown:
        return str(shown)
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def settings_doc() -> str:
    """docs/settings.md: every variable fedq reads, its default and what it does, made
    from the declarations of :class:`Settings`."""
    lines = ["# Settings", "",
             "Generated from the declarations in fedq/settings.py by "
             "`.venv/bin/python -m fedq.settings > docs/settings.md`. Every setting is an "
             "environment variable; an unknown `FEDQ_*` variable is refused by name (a "
             "typo would otherwise fall back to the embedded default). Booleans are `1` "
             "or `0`.", "",
             "| variable | default | what it does |", "|---|---|---|"]
    for name, key in ENV.items():
        doc = (Settings.model_fields[name].description or "").replace("``", "`")
        doc = doc.replace("|", "\\|")
        lines.append(f"| `{ENV_PREFIX}{key}` | {_shown(name)} | {doc} |")
        if key in _SECRET:
            lines.append(f"| `{ENV_PREFIX}{key}_FILE` | unset | a file holding "
                         f"`{ENV_PREFIX}{key}` (a Docker secret; set one of the two) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(settings_doc(), end="")
