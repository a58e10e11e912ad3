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


def test_a_redis_broker_gets_the_transport_with_one_client_per_channel(
        redis_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fedq/engine/redis_transport.py: fedq's app makes it the transport of redis://
    URLs, and its channel sends every command outside the event loop through one
    client object (kombu builds one per message), a new one only for a new pool."""
    from fedq.engine import app, redis_transport

    assert app.app.main == "fedq"  # importing fedq's app installed the transport

    made: list[object] = []  # the clients built for commands outside the event loop
    build = redis_transport.redis.Channel._create_client

    def counting(self: object, asynchronous: bool = False) -> object:
        client = build(self, asynchronous)
        if not asynchronous:
            made.append(client)
        return client

    monkeypatch.setattr(redis_transport.redis.Channel, "_create_client", counting)
    queue = Queue("fedq-test-q", Exchange("fedq-test-q", type="direct"),
                  routing_key="fedq-test-q")
    with Connection(redis_db) as conn:
        assert isinstance(conn.transport, redis_transport.Transport)
        assert conn.as_uri().startswith("redis://")  # as the banner, logs and Flower read it
        channel = conn.channel()
        queue(channel).declare()
        producer = conn.Producer(channel)
        for i in range(5):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="fedq-test-q")
        got: list[dict[str, int]] = []
        with conn.Consumer(queue, channel=channel,
                           callbacks=[lambda body, msg: (msg.ack(), got.append(body))]):
            while len(got) < 5:
                conn.drain_events(timeout=5)
        assert [b["i"] for b in got] == list(range(5))
        assert len(made) == 1, made  # kombu's own: one per declare, publish, take and ack
        channel._pool = None  # a reconnect's new pool: a client for it
        assert channel._create_client().connection_pool is channel.pool
        assert len(made) == 2
    with Connection("rediss://127.0.0.1:1/0") as tls:
        assert isinstance(tls.transport, redis_transport.Transport)


def test_publishes_in_a_batch_go_out_together_at_its_end_and_not_at_all_on_error(
        redis_db: str) -> None:
    """fedq/engine/redis_transport.py's ``batched_publishes``: tasks Celery sends inside
    the block reach Redis together when it ends (one pipeline, in the order sent), none
    before; when the block raises, none at all; past ``_MAX_BATCH`` commands, a full
    pipeline goes out at once (a large round's workers start on its first tasks).
    Celery's own send path, a separate app on the same Redis, Celery's own routing."""
    import redis
    from celery import Celery

    from fedq.engine import redis_transport
    from fedq.engine.redis_transport import batched_publishes

    celery = Celery("batch-test", broker=redis_db)
    client = redis.Redis.from_url(redis_db)
    try:
        with batched_publishes():
            for i in range(3):
                celery.send_task("t", args=(i,), queue="batch-q")
            assert client.llen("batch-q") == 0  # buffered, not sent
            with batched_publishes():  # a nested block joins the outer one
                celery.send_task("t", args=(3,), queue="batch-q")
            assert client.llen("batch-q") == 0
        bodies = [json.loads(m) for m in client.lrange("batch-q", 0, -1)]
        assert [m["headers"]["argsrepr"] for m in reversed(bodies)] == [
            "(0,)", "(1,)", "(2,)", "(3,)"]  # LPUSH: the newest first
        client.delete("batch-q")

        with pytest.raises(KeyError), batched_publishes():
            celery.send_task("t", args=(0,), queue="batch-q")
            raise KeyError("the third queue of a round")
        assert client.llen("batch-q") == 0
        celery.send_task("t", args=(1,), queue="batch-q")  # outside a block: at once
        assert client.llen("batch-q") == 1
        client.delete("batch-q")

        size = redis_transport._MAX_BATCH
        with batched_publishes():
            for i in range(size + 3):
                celery.send_task("t", args=(i,), queue="batch-q")
            assert client.llen("batch-q") == size  # the first full pipeline, sent
        assert client.llen("batch-q") == size + 3
    finally:
        celery.close()
        client.close()


def test_a_round_a_buffered_refill_and_inference_shards_are_sent_in_one_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where fedq sends many tasks at once it sends them inside ``batched_publishes``
    (the test above shows what that does on Redis): a round's chord, a buffered job's
    refill, an inference job's shards. Each records whether a batch was open as Celery
    was handed the tasks."""
    from fedq.coordinator import buffered, rounds
    from fedq.coordinator.planning import Assignment
    from fedq.engine import redis_transport
    from fedq.engine.app import SentEvents, app
    from fedq.inference import jobs as inference_jobs
    from fedq.protocol.training import BlobRef
    from fedq.settings import Settings
    from fedq.spec import JobSpec
    from fedq.testing.cluster import DIGITS

    def batching() -> bool:
        return getattr(redis_transport._batch, "sessions", None) is not None

    seen: list[tuple[str, bool]] = []
    monkeypatch.setattr(rounds, "chord",
                        lambda header: lambda body: seen.append(("round", batching())))
    # and each task hands its task-sent event to the batch's SentEvents (one message)
    monkeypatch.setattr(app, "send_task", lambda name, **kw: seen.append(
        (name, batching() and isinstance(kw.get("event_dispatcher"), SentEvents))))
    spec = JobSpec.model_validate({**DIGITS, "name": "batch"})
    model = BlobRef("jobs/j1/r00000/global.safetensors", "0" * 64, 10)
    rounds.dispatch("j1", 1, spec, model, [Assignment(0, "cpu")], attempt=1, gen=1)
    settings = Settings.model_construct()  # (not read: nothing is refused)
    buffered._send(settings, "j1", spec, [buffered.Dispatch(1, 1, 0, "cpu", 1, model, None)])
    inference_jobs._send(settings, "j2", [inference_jobs.Take("cpu", "t1", {"attempt": 1}, 0,
                                                              False)])
    assert seen == [("round", True), ("fedq.train", True), ("fedq.infer_shard", True)], seen
