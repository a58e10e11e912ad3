"""``fedq doctor --services``: can this machine reach the broker and the blob store,
how long does a model-sized blob take each way, and which of a registered worker's
limits hold for the credentials it runs with (fedq/worker/limits.py)?"""

from __future__ import annotations

import os
import platform
import secrets
import time
from typing import Any

import fedq.digest as digests
from fedq.blobs import store_for
from fedq.engine.broker import check_broker
from fedq.errors import BlobError, FedqError
from fedq.redaction import redact
from fedq.settings import Settings

#: The probe blob: about a small CNN's update; a ResNet-18 is 45 MB.
PROBE_BYTES = 10 * 2**20


def check_services(settings: Settings, size: int = PROBE_BYTES) -> dict[str, Any]:
    """Connect to the broker (seconds to connect) and write, read back and delete a
    ``size``-byte random blob (seconds and MB/s each way; the digest is checked on
    read as for every blob), then check a registered worker's limits (``limits``; for a
    joined worker each one that does not hold is a problem). Failures come back as
    ``problems``, never raised."""
    import fedq.identity as identity
    from fedq.worker.limits import PROBE_JOB, worker_limits

    report: dict[str, Any] = {"broker": redact(settings.broker_url),
                              "blob_store": redact(settings.blob_url), "problems": []}
    started = time.perf_counter()
    try:
        check_broker(timeout=5.0)
        report["broker_connect_seconds"] = time.perf_counter() - started
    except FedqError as exc:
        report["problems"].append(str(exc))
    try:
        store = store_for(settings)
        report["blob_layout"] = store.layout()
        if (room := store.room()) is not None:  # Redis's maxmemory
            report["blob_room"] = room[1]
        data = os.urandom(size)
        # a joined worker may write only its own updates: the probe is one
        key = (f"jobs/{PROBE_JOB}/updates/{settings.joined_as}/" if settings.joined_as
               else "doctor/") + f"{platform.node()}-{secrets.token_hex(4)}"
        started = time.perf_counter()
        ref = store.put(key, data)
        up = time.perf_counter() - started
        started = time.perf_counter()
        back = store.get(ref)
        down = time.perf_counter() - started
        store.delete_keys([key])
        if digests.of(back) != digests.of(data):
            raise BlobError(f"blob {key} came back different")
        report.update(blob_bytes=size, upload_seconds=up, download_seconds=down,
                      upload_mb_per_s=size / 1e6 / up if up else None,
                      download_mb_per_s=size / 1e6 / down if down else None)
    except FedqError as exc:
        report["problems"].append(str(exc))
    except Exception as exc:  # a driver's own error (botocore, redis): one line
        report["problems"].append(f"blob store {redact(settings.blob_url)}: "
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    joined = identity.joined(settings.keys_dir)
    limits = worker_limits(settings, settings.joined_as, joined.queues if joined else ())
    report["limits"] = [limit.to_json() for limit in limits]
    report["joined_as"] = settings.joined_as
    if settings.joined_as:
        report["problems"] += [f"worker {settings.joined_as} can do more than it needs: "
                               f"'{limit.what}' does not hold ({limit.detail})"
                               for limit in limits if limit.holds is False]
    return report
