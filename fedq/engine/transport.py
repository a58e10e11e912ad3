"""Celery's filesystem broker with atomic message files (the embedded default).

kombu's filesystem transport (5.7.0) creates a message file and then writes it; a
consumer in another process that lists the folder in between moves the still-empty
file away and fails to parse it ("JSONDecodeError: Expecting value"), which kills the
worker's consumer and loses the message. We saw this with 16 jobs submitted at once
on the embedded default (tests/test_strategy_jobs.py). Here a message is written under
a temporary name the consumer ignores, then renamed into place: rename within one
folder is atomic, so a consumer sees a whole message or none.

The exchange tables have the same race: binding a queue creates
``<exchange>.exchange`` and then locks and writes it, so a second worker starting at
the same moment can lock the still-empty file first and fail to parse it (seen when
three embedded workers bound the ``cpu`` queue at once; CI, stop 37). Here a table is
created and filled under one exclusive lock, and an empty table reads as no bindings.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps, loads


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


    def get_table(self, exchange: Any) -> list:  # type: ignore[override]
        file = self._exchange_file(exchange)
        try:
            with open(file, "rb") as fh:
                filesystem.lock(fh, filesystem.LOCK_SH)
                try:
                    return _table(fh.read())
                finally:
                    filesystem.unlock(fh)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc

    def _queue_bind(self, exchange: Any, routing_key: Any, pattern: Any,  # type: ignore[override]
                    queue: Any) -> None:
        file = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        try:
            # create without truncating, then hold the lock while reading and writing
            with open(os.open(file, os.O_RDWR | os.O_CREAT, 0o644), "r+b", buffering=0) as fh:
                filesystem.lock(fh, filesystem.LOCK_EX)
                try:
                    bindings = _table(fh.read())
                    if binding not in bindings:
                        bindings.insert(0, binding)
                        fh.seek(0)
                        fh.truncate()
                        fh.write(dumps(bindings).encode())
                finally:
                    filesystem.unlock(fh)
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc

    def _delete(self, queue: Any, exchange: Any, routing_key: Any, pattern: Any,  # type: ignore[override]
                *args: Any, **kwargs: Any) -> None:
        # the virtual channel's bookkeeping, without the file handling replaced here
        super(filesystem.Channel, self)._delete(queue, exchange, routing_key, pattern,
                                                *args, **kwargs)
        file = self._exchange_file(exchange)
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        try:
            with open(file, "r+b", buffering=0) as fh:
                filesystem.lock(fh, filesystem.LOCK_EX)
                try:
                    bindings = _table(fh.read())
                    if binding in bindings:
                        bindings.remove(binding)
                        fh.seek(0)
                        fh.truncate()
                        fh.write(dumps(bindings).encode())
                finally:
                    filesystem.unlock(fh)
        except FileNotFoundError:
            return


def _table(raw: bytes) -> list:
    """An exchange table's bindings; a file another process has only just created is
    empty and has none yet."""
    if not raw.strip():
        return []
    return [filesystem.exchange_queue_t(*row) for row in loads(raw.decode())]


class Transport(filesystem.Transport):
    Channel = Channel
