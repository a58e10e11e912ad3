"""Celery's filesystem broker with atomic message files (the embedded default).

kombu's filesystem transport (5.7.0) creates a message file and then writes it; a
consumer in another process that lists the folder in between moves the still-empty
file away and fails to parse it ("JSONDecodeError: Expecting value"), which kills the
worker's consumer and loses the message. We saw this with 16 jobs submitted at once
on the embedded default (tests/test_strategy_jobs.py). Here a message is written under
a temporary name the consumer ignores, then renamed into place: rename within one
folder is atomic, so a consumer sees a whole message or none.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        tmp = os.path.join(self.data_folder_out, f".tmp-{uuid.uuid4()}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(dumps(payload).encode())
            os.replace(tmp, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
