"""The embedded default's broker: kombu's filesystem transport with fedq's fixes for
the races between processes (fedq/engine/transport.py)."""

from __future__ import annotations

import json
import multiprocessing
import uuid
from pathlib import Path

import pytest
from kombu import Connection, Exchange, Queue
from kombu.transport import filesystem

from fedq.engine.transport import Transport

pytestmark = pytest.mark.timeout(60)


def _connection(root: Path, transport: type = Transport) -> Connection:
    folder = root / "data"
    folder.mkdir(exist_ok=True)
    return Connection(transport=transport, transport_options={
        "data_folder_in": str(folder), "data_folder_out": str(folder),
        "control_folder": str(root / "control")})


def test_a_table_another_process_has_only_created_is_bound_to(tmp_path: Path) -> None:
    """The state a second worker meets while the first is between creating
    ``cpu.exchange`` and writing it: an empty file. kombu's own channel fails to parse
    it (that killed a starting worker in CI); fedq's binds and keeps one table."""
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "cpu.exchange").write_bytes(b"")
    with _connection(tmp_path, filesystem.Transport) as kombu_conn:
        with pytest.raises(json.JSONDecodeError):
            kombu_conn.default_channel._queue_bind("cpu", "cpu", None, "cpu")
    with _connection(tmp_path) as conn:
        channel = conn.default_channel
        assert channel.get_table("cpu") == []
        channel._queue_bind("cpu", "cpu", None, "cpu")
        channel._queue_bind("cpu", "cpu", None, "cpu")
        channel._queue_bind("cpu", "other", None, "other")
        assert [q.queue for q in channel.get_table("cpu")] == ["other", "cpu"]
        channel._delete("other", "cpu", "other", None)
        assert [q.queue for q in channel.get_table("cpu")] == ["cpu"]


def _bind(root: str, start: multiprocessing.synchronize.Event, name: str) -> None:
    start.wait()
    with _connection(Path(root)) as conn:
        conn.default_channel._queue_bind("cpu", name, None, name)


def test_workers_starting_at_once_all_bind(tmp_path: Path) -> None:
    """Eight processes bind to one new exchange at the same moment: every binding is in
    the table and none fails."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    names = [f"q{i}" for i in range(8)]
    procs = [ctx.Process(target=_bind, args=(str(tmp_path), start, n)) for n in names]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    with _connection(tmp_path) as conn:
        assert sorted(q.queue for q in conn.default_channel.get_table("cpu")) == names


def test_messages_round_trip_and_half_written_files_are_not_read(tmp_path: Path) -> None:
    """A message is renamed into place whole; a temporary file still being written is
    not taken for a message."""
    # A name of its own: kombu keeps the bindings a process declared in one state shared
    # by every connection, so a "cpu" queue another test bound in this process would be
    # taken as bound here too, and never written to this test's folder.
    name = f"q{uuid.uuid4().hex[:8]}"
    with _connection(tmp_path) as conn:
        queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
        (tmp_path / "data" / ".tmp-half-written").write_bytes(b'{"bo')
        producer = conn.Producer()
        producer.publish({"n": 1}, exchange=queue.exchange, routing_key=name,
                         declare=[queue], serializer="json")
        got = queue(conn.default_channel).get(no_ack=True)
        assert got is not None and got.payload == {"n": 1}
        assert queue(conn.default_channel).get(no_ack=True) is None
