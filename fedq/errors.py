"""Every error fedq expects to happen, rooted at :class:`FedqError`.

The CLI prints ``str(err)`` (one line per mistake) and exits with ``err.exit_code``;
no traceback is shown for these. Anything else is a bug and keeps its traceback.

Exit codes: 1 other expected failure, 2 bad input (spec, settings), 3 a service is
unreachable or the schema is old, 4 no such job, 5 the watched job failed, 6 the
watched job was cancelled, 7 ``fedq watch --timeout`` ran out.
"""

from __future__ import annotations


class FedqError(Exception):
    """Base of all expected failures."""

    exit_code = 1


class ConfigError(FedqError):
    """A FEDQ_* setting is missing or malformed."""

    exit_code = 2


class SpecError(FedqError):
    """A job spec is invalid; the message names the file and the field."""

    exit_code = 2


class UnknownModel(SpecError):
    """The spec names a model the registry does not have."""


class UnknownDataset(SpecError):
    """The spec names a dataset fedq does not know."""


class DataUnavailable(FedqError):
    """A dataset cannot be read (missing data_dir, no download possible)."""


class ServiceUnavailable(FedqError):
    """The broker, database or blob store cannot be reached."""

    exit_code = 3


class TrainingDiverged(FedqError):
    """A client's local training ended with a loss that is not a finite number."""


class BlobError(FedqError):
    """Base of blob store failures."""


class BlobNotFound(BlobError):
    """No blob under the key."""


class BlobIntegrityError(BlobError):
    """A blob's bytes do not hash to the digest its reference carries."""


class BlobTooLarge(BlobError):
    """A blob is larger than what it stands for can be (an update bigger than its
    model): refused before it is read."""


class UpdateRejected(FedqError):
    """A client update failed verification (shape, dtype, finite, norm)."""


class JobNotFound(FedqError):
    """No job with that id."""

    exit_code = 4


class JobFailed(FedqError):
    """The job being watched failed."""

    exit_code = 5


class JobCancelled(FedqError):
    """The job being watched was cancelled."""

    exit_code = 6


class WatchTimeout(FedqError):
    """``fedq watch --timeout`` ran out before the job finished."""

    exit_code = 7


class SchemaOutOfDate(FedqError):
    """The database has not been migrated to the current schema."""

    exit_code = 3


class MissingExtra(ConfigError):
    """A feature needs an optional dependency that is not installed."""


def require_extra(module: str, extra: str, needed_for: str) -> None:
    """Raise :class:`MissingExtra` naming the pip extra unless ``module`` is importable."""
    from importlib.util import find_spec

    if find_spec(module) is None:
        raise MissingExtra(f"{needed_for} needs the Python package {module!r}, which is not "
                           f"installed: pip install 'fedq[{extra}]'")
