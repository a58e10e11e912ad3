"""``fedq serve``: an HTTP gateway (Starlette on uvicorn) in front of the workers.

Requests are collected into batches (at most ``max_batch`` items, or whatever has come
within ``max_wait_ms`` of a batch's first item, as Ray Serve's ``@serve.batch``; with
no batch out, a batch goes at once with what is queued: nothing to wait for); each
batch is one ``fedq.serve_batch`` task on a hardware queue, to a worker that keeps the
model loaded; its answer comes back through the result backend and is checked like a
shard's (fedq/protocol/inference.py) before any of it is returned. While every live
worker holds a batch, the next one keeps growing until a batch comes back, it is full,
or it has waited twice the quickest queue's round trip (``Batcher.hold_s``): sent at
once it would only wait in the broker, as a small batch that costs a worker nearly
what a full one does.

- Routing: the fastest class with a live worker among the queues given
  (gpu_new, then gpu_sm61, then cpu), looked up again every ``ROUTE_EVERY_S``.
- Back-pressure: past ``max_queue`` items waiting or out, a request is answered 503
  with ``Retry-After``; the gateway never holds more.
- A lost batch (no answer within ``batch_timeout_s``, or a refused one) is sent once
  more; then its requests get 504 (no answer) or 502 (a refused answer).
- ``FEDQ_SERVE_API_KEY`` set: every request but ``/health`` needs
  ``Authorization: Bearer KEY`` (compared in constant time).
- ``"stream": true`` on a completion: server-sent events as OpenAI's API sends them.
  A batch with a streamed request says so (``stream`` in its message), and its worker
  writes each item's text so far into the batch task's state (``STREAMING``, at most
  every 50 ms; a batch without one gets only the answer); the gateway, which polls
  that state anyway, checks it (a list of strings, no longer than the items'
  ``max_tokens``) and sends what was added. The final answer is checked as a
  non-streamed one is; if it does not continue what was streamed, the stream ends
  with an error event; with ``stream_options: {"include_usage": true}`` a last chunk
  carries the request's usage. Streamed pieces are
  signed too (with identity required, a piece not signed for its task by a registered
  worker is dropped, as an unsigned answer is refused).
- A batch's stored state is read only up to :func:`answer_bytes` (its items times the
  longest output line their op may have, plus room for the signature): a longer one
  is a refused answer, not read from the key and not decoded from its notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import fedq.identity as identity
from fedq.engine.app import app
from fedq.engine.backend import TOO_LARGE, UNDECODABLE, decode_state, task_metas
from fedq.engine.names import SERVE_TASK, STREAM_STATE, TRAINING_QUEUES
from fedq.inference.run import encode_rows
from fedq.protocol.envelope import MESSAGE_FORMAT, FormatError
from fedq.protocol.inference import LINE_BYTES, check_output
from fedq.redaction import redact_text

log = logging.getLogger(__name__)

ROUTE_EVERY_S = 15.0
KEYS_EVERY_S = 3.0
MAX_ITEMS_PER_REQUEST = 256
MAX_PROMPT_BYTES = 16_384
SEND_GRACE_S = 2.0  # beyond batch_timeout_s, for a batch's send and its revocation
DECODE_INLINE_BYTES = 65_536  # a published state up to this size is decoded in the loop
#: Room in a batch's stored state beside its output lines: Celery's envelope, the
#: worker's name and time, a signature (about 200 bytes), JSON's keys between lines.
ANSWER_ROOM_BYTES = 16_384


READ_TIMEOUT_S = 10.0  # a request body not whole by then: 408
#: How deep a request's JSON may nest (the deepest legal one, a batch of images, is
#: the image's dimensions plus two).
MAX_JSON_DEPTH = 16
#: The most characters one number or one prompt byte takes in a legal request's JSON
#: (a float's repr with its separator; a control byte escaped as \u00XX).
NUMBER_CHARS = 32
ESCAPE_CHARS = 6
BODY_ROOM_BYTES = 65_536  # a request's keys, options and whitespace


def body_bound(served: Served) -> int:
    """The largest legal request body for ``served``: :data:`MAX_ITEMS_PER_REQUEST`
    inputs of the model's shape (classifiers) or prompts of :data:`MAX_PROMPT_BYTES`
    (language models), each at its longest in JSON."""
    if served.op == "classify":
        item = math.prod(served.input_shape) * NUMBER_CHARS
    else:
        item = MAX_PROMPT_BYTES * ESCAPE_CHARS
    return MAX_ITEMS_PER_REQUEST * item + BODY_ROOM_BYTES


class BadBody(Exception):
    """A request body refused before it is parsed: too large (413), too slow (408), or
    not JSON within :data:`MAX_JSON_DEPTH` (400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_json(request: Any, limit: int, timeout_s: float) -> Any:
    """A request's body parsed as JSON, read no further than ``limit`` bytes (a
    ``Content-Length`` over it is refused unread) and within ``timeout_s`` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadBody(413, f"the request body is {int(declared)} bytes, more than the "
                           f"{limit} a request may have")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadBody(413, f"the request body is more than the {limit} bytes a "
                                   f"request may have")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        data = await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise BadBody(408, f"the request body did not arrive within {timeout_s:g} s") from None
    try:
        body = json.loads(data)
    except RecursionError:
        raise BadBody(400, f"the request's JSON nests deeper than {MAX_JSON_DEPTH}") from None
    except ValueError as exc:
        raise BadBody(400, f"the request body is not JSON: {str(exc)[:100]}") from None
    if _depth_over(body, MAX_JSON_DEPTH):
        raise BadBody(400, f"the request's JSON nests deeper than {MAX_JSON_DEPTH}")
    return body


def _depth_over(value: Any, bound: int) -> bool:
    """Whether ``value`` (parsed JSON) nests deeper than ``bound`` (no recursion)."""
    level: list[Any] = [value] if isinstance(value, (list, dict)) else []
    for _ in range(bound):  # level: the containers at depth 1, 2, ...
        level = [v for x in level if isinstance(x, (list, dict))
                 for v in (x.values() if isinstance(x, dict) else x)
                 if isinstance(v, (list, dict))]
    return bool(level)


def answer_bytes(op: str, n: int) -> int:
    """The most bytes the stored state of a batch of ``n`` items for ``op`` may have:
    each output is one of a shard's lines (``LINE_BYTES``), which a streamed piece
    (texts no longer than ``max_tokens``) is within too."""
    return n * (LINE_BYTES[op] + 64) + ANSWER_ROOM_BYTES


#: OpenAI's error ``type`` for each HTTP status fedq answers with (its API reference's
#: error codes); anything else 5xx is a ``server_error``.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error",
               413: "invalid_request_error", 415: "invalid_request_error",
               429: "rate_limit_error"}


def error_object(status: int, message: str) -> dict[str, Any]:
    """An error as OpenAI's API answers one: ``{"error": {"message", "type", "param",
    "code"}}``; the HTTP status is the response's (``code`` is None: fedq has no
    finer error codes)."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class Refused(Exception):
    """A batch's answer that did not check out (status 502), or none came (504)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Served:
    """What is served: the model's blob and shape, and how to batch and route."""

    name: str
    op: str  # classify | generate
    model: dict[str, Any]  # blob ref
    arch: dict[str, Any]
    classes: int
    input_shape: tuple[int, ...]
    queues: list[str]
    width: int | None = None  # a language model's embedding width (/v1/embeddings)
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_queue: int = 1024
    batch_timeout_s: float = 30.0
    api_key: str | None = None
    max_tokens: int = 256
    # FEDQ_IDENTITY=required: the coordinator's keys folder (batches are sealed with
    # them) and a reader of the registered workers (answers must be signed by one),
    # called again every ROUTE_EVERY_S so that a revocation holds
    keys: Any = None
    read_registry: Any = None
    registry: Any = None
    # API keys one per person (fedq/inference/keys.py): a reader of the table, read at
    # start and every KEYS_EVERY_S, and what it last read
    read_key_table: Any = None
    key_table: Any = None
    # what a request body may be: bytes at most (None: :func:`body_bound`, the largest
    # legal request), seconds to arrive whole
    max_body: int | None = None
    read_timeout_s: float = READ_TIMEOUT_S

    @property
    def body_limit(self) -> int:
        return self.max_body if self.max_body is not None else body_bound(self)


@dataclass
class _Item:
    body: Any
    future: asyncio.Future[tuple[Any, int]]
    texts: asyncio.Queue[str] | None = None  # streamed: each newer text so far
    last: str = ""


@dataclass
class Notice:
    """A waiter's doorbell, and the states published for its task, oldest first."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    states: list[Any] = field(default_factory=list)

    async def next_state(self, timeout: float, bound: int) -> dict[str, Any] | None:
        """The next published state, decoded as the backend decodes what it reads from
        the key; None when none came within ``timeout`` seconds. One longer than
        ``bound`` bytes is refused undecoded."""
        if not self.states:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.event.wait(), timeout)
            self.event.clear()
        if not self.states:
            return None
        data = self.states.pop(0)
        if not isinstance(data, (bytes, str)):
            return None
        if len(data) > bound:
            raise too_long(len(data), bound)
        if len(data) > DECODE_INLINE_BYTES:  # a large answer: off the event loop
            return await asyncio.to_thread(decoded, decode_state, app.backend, data)
        return decoded(decode_state, app.backend, data)


def too_long(size: int, bound: int) -> Refused:
    return Refused(502, f"the batch's answer is {size} bytes, more than the {bound} its "
                        "items may have; not read")


def read_state(task_id: str, bound: int) -> dict[str, Any]:
    """A batch task's state read from its key, up to ``bound`` bytes (a longer one is
    refused unread), decoded as :func:`decoded` does."""
    meta = decoded(lambda: task_metas(app.backend, [task_id], bound)[0])
    if meta.get("status") == TOO_LARGE:
        raise too_long(meta["bytes"], bound)
    return meta


def decoded(read: Any, *args: Any) -> dict[str, Any]:
    """A task's state as the result backend decodes it (``read(*args)``); a state that
    does not decode (fedq.engine.backend.decode_state) is a refused answer, never a
    crash."""
    meta = read(*args)
    if not isinstance(meta, dict):
        raise Refused(502, f"the batch's answer is a {type(meta).__name__}, not an object")
    if meta.get("status") == UNDECODABLE:
        raise Refused(502, f"the batch's answer does not decode: {meta.get('error')}")
    return meta


class ResultWatch:
    """Wakes a batch's waiter when the result backend stores its task's state.

    Celery's Redis result backend publishes every state it stores (a stream's pieces,
    the answer) on the channel named by the task's key; one pattern subscription for
    the gateway's task ids hears them all, so a waiter has the state as soon as it is
    written instead of at its next poll. The backend publishes the very value it
    stores (``SET`` and ``PUBLISH`` in one pipeline), so the waiter takes the state from
    the notice, without a ``GET``: the same bytes, from the same writer (a worker's
    Redis user may write ``celery-task-meta-*`` keys and publish on the channels of the
    same names, nothing more: fedq/coordinator/acl.py), checked exactly as a state read
    from its key. The waiter still reads the key, slowly, in case a notice is lost (a
    reconnect)."""

    PATTERN = "fedq-serve-*"

    def __init__(self, url: str) -> None:
        import redis.asyncio

        self.client = redis.asyncio.Redis.from_url(url)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.waiting: dict[bytes, Notice] = {}
        self.heard = 0  # notices that woke a waiter (/health)
        self.prefix = app.backend.task_keyprefix
        if isinstance(self.prefix, str):
            self.prefix = self.prefix.encode()

    async def start(self) -> None:
        await self.pubsub.psubscribe(self.prefix + self.PATTERN.encode())

    async def listen(self) -> None:
        """Set the event of each task whose state was stored; runs until cancelled."""
        while True:
            try:
                message = await self.pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the waiters poll meanwhile
                log.warning("fedq serve: result notices lost (%s); polling", exc)
                await asyncio.sleep(1.0)
                with contextlib.suppress(Exception):
                    await self.start()
                continue
            if message is not None:
                notice = self.waiting.get(message.get("channel", b""))
                if notice is not None:
                    notice.states.append(message.get("data"))
                    notice.event.set()
                    self.heard += 1

    def watch(self, task_id: str) -> Notice:
        notice = Notice()
        self.waiting[self.prefix + task_id.encode()] = notice
        return notice

    def forget(self, task_id: str) -> None:
        self.waiting.pop(self.prefix + task_id.encode(), None)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.pubsub.aclose()
            await self.client.aclose()


def result_watch(url: str) -> ResultWatch | None:
    """A watch on a Redis result backend ``url``; None for other backends (polled)."""
    if not url.startswith(("redis://", "rediss://")):
        return None
    try:
        return ResultWatch(url)
    except Exception as exc:  # noqa: BLE001 - polling works without it
        log.warning("fedq serve: no result notices (%s); polling", exc)
        return None


@dataclass
class Router:
    """Which queue a batch goes to: the live queue expected to answer soonest.

    Each queue's expected time is the moving average of its batches' round trips (sent
    to answered), scaled by its batches out per live worker, so a loaded GPU queue
    gives way to an idle CPU one and takes batches again as its backlog clears. A live
    queue measured fewer than twice takes the next batch (the faster class first: a GPU
    worker that came is tried at once); its first round trip, which includes loading the
    model, is replaced by its second rather than averaged in (a cold first batch would
    otherwise keep a fast queue looking slow until probes wore it down); every
    ``PROBE_EVERY``-th batch goes to the live queue measured longest ago, so that an
    estimate does not go stale. A batch with no answer counts as the whole timeout. Ties
    go to the faster class (gpu_new, gpu_sm61, cpu)."""

    order: list[str]  # the served queues, fastest class first
    live: dict[str, int] = field(default_factory=dict)  # queue -> live workers
    slots: dict[str, int] = field(default_factory=dict)  # queue -> their tasks at once
    ewma: dict[str, float] = field(default_factory=dict)  # queue -> seconds a batch
    measured: dict[str, int] = field(default_factory=dict)  # queue -> batch no. of last
    samples: dict[str, int] = field(default_factory=dict)  # queue -> round trips measured
    out: dict[str, int] = field(default_factory=dict)  # queue -> batches out
    sent: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # queue -> batches sent

    ALPHA = 0.3
    PROBE_EVERY = 20
    WARM = 2  # round trips before a queue's estimate is compared; the first is replaced

    def expected(self, queue: str) -> float:
        return self.ewma[queue] * (1 + self.out.get(queue, 0) / max(self.live.get(queue, 1), 1))

    def candidates(self) -> list[str]:
        return [q for q in self.order if self.live.get(q)] or self.order[:1]

    def best(self) -> str:
        """The queue the next batch would go to, apart from probes."""
        candidates = self.candidates()
        unmeasured = [q for q in candidates if self.samples.get(q, 0) < self.WARM]
        if unmeasured:  # measured warm before anything is compared (fastest class first)
            return unmeasured[0]
        return min(candidates, key=self.expected)  # ties: the faster class (order)

    def choose(self) -> str:
        """The queue for the next batch (counted as out until :meth:`done`)."""
        self.sent += 1
        candidates = self.candidates()
        queue = self.best()
        if self.sent % self.PROBE_EVERY == 0 and len(candidates) > 1:
            others = [q for q in candidates if q != queue]
            queue = min(others, key=lambda q: self.measured.get(q, -1))
        self.out[queue] = self.out.get(queue, 0) + 1
        self.counts[queue] = self.counts.get(queue, 0) + 1
        return queue

    def done(self, queue: str, seconds: float) -> None:
        """A batch sent to ``queue`` came back after ``seconds`` (or failed: the timeout)."""
        self.out[queue] = max(self.out.get(queue, 0) - 1, 0)
        self.samples[queue] = self.samples.get(queue, 0) + 1
        before = self.ewma.get(queue)
        self.ewma[queue] = seconds if before is None or self.samples[queue] <= self.WARM \
            else (1 - self.ALPHA) * before + self.ALPHA * seconds
        self.measured[queue] = self.sent

    def to_json(self) -> dict[str, Any]:
        return {q: {"live_workers": self.live.get(q, 0), "slots": self.slots.get(q, 0),
                    "batches": self.counts.get(q, 0),
                    "out": self.out.get(q, 0),
                    "batch_s": round(self.ewma[q], 4) if q in self.ewma else None}
                for q in self.order}


@dataclass
class Batcher:
    served: Served
    op: str = ""  # what its batches ask of the workers (default: the served op)
    queue: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    pending: int = 0  # items waiting or out
    out: int = 0  # batches out
    router: Router | None = None
    batches: list[int] = field(default_factory=list)  # sizes sent (the last 1000)
    metrics: Any = None
    watch: ResultWatch | None = None  # notices of stored states (else polled)
    from_notices: int = 0  # states taken from a notice, not read from their key
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # an item came, a batch back

    def __post_init__(self) -> None:
        self.op = self.op or self.served.op
        if self.router is None:
            self.router = Router([q for q in TRAINING_QUEUES if q in self.served.queues]
                                 or list(self.served.queues))

    def admit(self, bodies: list[Any], stream: bool = False) -> list[_Item] | None:
        """Queue the items, or None when that would pass ``max_queue`` (a 503)."""
        if self.pending + len(bodies) > self.served.max_queue:
            return None
        loop = asyncio.get_running_loop()
        items = []
        for body in bodies:
            item = _Item(body, loop.create_future(), asyncio.Queue() if stream else None)
            self.queue.put_nowait(item)
            items.append(item)
        self.pending += len(bodies)
        self.wake.set()
        return items

    def capacity(self) -> int:
        """Batches that keep the workers busy: one per task a live worker of the served
        queues runs at once (its ``-c``; at least one in all)."""
        assert self.router is not None
        r = self.router
        return max(sum(r.slots.get(q, r.live.get(q, 0)) for q in r.order), 1)

    def hold_s(self) -> float:
        """How long a batch may wait for a worker to come free: twice the quickest
        live queue's measured round trip (nothing measured yet: no wait)."""
        assert self.router is not None
        trips = [self.router.ewma[q] for q in self.router.candidates() if q in self.router.ewma]
        return 2 * min(trips) if trips else 0.0

    async def run(self) -> None:
        """Collect batches forever; each is sent without waiting for the one before,
        except while every worker holds one (:meth:`_grow_while_busy`)."""
        while True:
            first = await self.queue.get()
            began = time.monotonic()
            batch = [first]
            # No batch out: nothing to wait for, so no reason to hold the first item back
            # (what is queued already still joins it). Else wait up to max_wait_ms.
            wait = self.served.max_wait_ms / 1000 if self.out else 0.0
            deadline = began + wait
            while len(batch) < self.served.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._take_queued(batch)
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            await self._grow_while_busy(batch, began + self.hold_s())
            self.out += 1  # counted now: the next batch is formed before this task runs
            asyncio.create_task(self._dispatch(batch))

    def _take_queued(self, batch: list[_Item]) -> None:
        """Move what is queued into ``batch``, up to ``max_batch`` items."""
        while len(batch) < self.served.max_batch and not self.queue.empty():
            batch.append(self.queue.get_nowait())

    async def _grow_while_busy(self, batch: list[_Item], until: float) -> None:
        """While every worker holds a batch, take what comes into ``batch`` until a
        batch comes back, ``batch`` is full, or ``until`` (monotonic) has passed."""
        while True:
            self.wake.clear()
            self._take_queued(batch)
            left = until - time.monotonic()
            if len(batch) >= self.served.max_batch or self.out < self.capacity() or left <= 0:
                return
            try:
                await asyncio.wait_for(self.wake.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def _dispatch(self, batch: list[_Item]) -> None:
        """Send ``batch`` (counted in ``out`` by its sender) and answer its items."""
        n = len(batch)
        self.batches = (self.batches + [n])[-1000:]
        if self.metrics is not None:
            self.metrics.batch.observe(n)
        error = Refused(504, "no answer")
        try:
            for attempt in (1, 2):
                try:  # a send that hangs (a broker away) ends with the batch's timeout
                    outputs = await asyncio.wait_for(self._send(batch, attempt),
                                                     self.served.batch_timeout_s + SEND_GRACE_S)
                except asyncio.TimeoutError:
                    error = Refused(504, f"no answer within {self.served.batch_timeout_s:g}s")
                    log.warning("fedq serve: batch of %d, attempt %d: %s", n, attempt, error)
                    continue
                except Refused as exc:
                    error = exc
                    log.warning("fedq serve: batch of %d, attempt %d: %s", n, attempt, exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - the broker away, anything: a 502
                    error = Refused(502, f"the batch could not be sent or read: "
                                         f"{type(exc).__name__}: {redact_text(str(exc))[:200]}")
                    log.warning("fedq serve: batch of %d, attempt %d: %s", n, attempt, error)
                    continue
                for item, out in zip(batch, outputs):
                    if not item.future.done():
                        item.future.set_result((out, n))
                return
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
        finally:
            self.pending -= n
            self.out -= 1
            self.wake.set()

    async def _send(self, batch: list[_Item], attempt: int) -> list[dict[str, Any]]:
        s = self.served
        base = f"fedq-serve-{uuid.uuid4().hex[:16]}-a{attempt}"
        tid = base + identity.task_tag(base, s.keys)
        msg = {"format": MESSAGE_FORMAT, "op": self.op, "model": s.model, "arch": s.arch,
               "items": [item.body for item in batch]}
        if any(item.texts is not None for item in batch):
            msg["stream"] = True  # the worker writes its texts so far only when asked
        assert self.router is not None
        queue = self.router.choose()
        sent, took = time.perf_counter(), s.batch_timeout_s  # no answer: the whole timeout
        bound = answer_bytes(self.op, len(batch))
        stored = self.watch.watch(tid) if self.watch is not None else None
        try:
            await asyncio.to_thread(app.send_task, SERVE_TASK,
                                    args=(identity.seal(msg, tid, s.batch_timeout_s, s.keys),),
                                    queue=queue, task_id=tid, kwargsrepr="{}",
                                    argsrepr=f"{self.op} of {len(batch)} items")
            deadline = time.monotonic() + s.batch_timeout_s
            wait = 0.001
            while time.monotonic() < deadline:
                heard = await stored.next_state(0.05, bound) if stored is not None else None
                if heard is not None:  # the state as published when it was stored
                    self.from_notices += 1
                    meta = heard
                else:  # no notice (polled, or one lost): read the key
                    meta = await asyncio.to_thread(read_state, tid, bound)
                if meta.get("status") == STREAM_STATE:
                    _pass_on(batch, stream_texts(meta.get("result"), batch, s.registry, tid,
                                                 queue))
                if meta.get("status") == "SUCCESS":
                    outputs = check_batch(meta.get("result"), s, len(batch), tid, self.op,
                                          queue, [_max_tokens(item.body) for item in batch])
                    took = time.perf_counter() - sent
                    return outputs
                if meta.get("status") in ("FAILURE", "REVOKED"):
                    raise Refused(502, f"the batch task ended {meta.get('status')}")
                if stored is None:
                    await asyncio.sleep(wait)
                    wait = min(wait * 1.5, 0.02)
        finally:
            if self.watch is not None:
                self.watch.forget(tid)
            self.router.done(queue, took)
        app.control.revoke(tid)
        raise Refused(504, f"no answer within {s.batch_timeout_s:g}s on queue {queue}")

    def reroute(self) -> None:
        """The live workers of each served queue, for the router (and, with identity
        required, the registered workers read again)."""
        from fedq.engine.broker import live_queues, worker_slots

        if self.served.read_registry is not None:
            from sqlalchemy.exc import SQLAlchemyError

            try:
                self.served.registry = self.served.read_registry()
            except (OSError, SQLAlchemyError) as exc:  # the database away: keep the last
                log.warning("fedq serve: could not read the registered workers: %s", exc)

        try:
            live = live_queues(timeout=1.0)
            slots = worker_slots(timeout=1.0)
        except Exception:  # noqa: BLE001 - keep what we knew
            return
        assert self.router is not None
        self.router.live = {q: len(live.get(q) or []) for q in self.router.order}
        self.router.slots = {q: sum(slots.get(w, 1) for w in live.get(q) or [])
                             for q in self.router.order}


def stream_texts(data: Any, batch: list[_Item], registry: identity.Registry | None = None,
                 task_id: str = "", queue: str | None = None) -> list[str]:
    """A worker's progress on a batch of completions (its ``STREAMING`` state): the text
    so far of its first items; anything else, or a text longer than its item's
    ``max_tokens`` (one character per byte at most), is ignored. With identity required
    (``registry``), so is a piece not signed for ``task_id`` by an active registered
    worker: the result backend's entry is writable by any worker, and a streamed piece
    reaches the user before the signed answer does."""
    if registry is not None and (not isinstance(data, dict) or identity.result_problem(
            data, data.get("signer") if isinstance(data.get("signer"), str) else None,
            data.get("sig") if isinstance(data.get("sig"), str) else None, "?", task_id,
            registry, None if queue is None else [queue]) is not None):
        return []
    texts = data.get("stream") if isinstance(data, dict) else None
    if not isinstance(texts, list) or len(texts) > len(batch) or not all(
            isinstance(t, str) and isinstance(item.body, dict)
            and len(t) <= item.body.get("max_tokens", 0) for t, item in zip(texts, batch)):
        return []
    return texts


def _pass_on(batch: list[_Item], texts: list[str]) -> None:
    for item, text in zip(batch, texts):
        if item.texts is not None and text != item.last:
            item.last = text
            item.texts.put_nowait(text)


async def stream_events(item: _Item, head: dict[str, Any],
                        include_usage: bool = False) -> AsyncIterator[str]:
    """Server-sent events for one streamed completion: each piece added to its text,
    then the rest of the checked answer with ``finish_reason``, then ``[DONE]``. With
    ``include_usage`` (OpenAI's ``stream_options``) every chunk carries ``usage: null``
    and one more chunk, with no choices and the request's :func:`usage`, comes before
    ``[DONE]`` when the answer checked out."""
    more = {"usage": None} if include_usage else {}

    def event(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def piece(text: str, finish: str | None) -> str:
        return event({**head, "choices": [{"text": text, "index": 0, "logprobs": None,
                                           "finish_reason": finish}], **more})

    assert item.texts is not None
    sent = ""
    while True:
        newer: asyncio.Future[Any] = asyncio.ensure_future(item.texts.get())
        waiting: set[asyncio.Future[Any]] = {item.future, newer}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if newer.done():
            text = newer.result()
            if text.startswith(sent) and len(text) > len(sent):
                yield piece(text[len(sent):], None)
                sent = text
            continue
        newer.cancel()
        try:
            out, _ = item.future.result()
        except Refused as exc:
            yield event(error_object(exc.status, str(exc)))
        else:
            final = out["text"]
            if final.startswith(sent):
                yield piece(final[len(sent):], "length")
                if include_usage:
                    yield event({**head, "choices": [],
                                 "usage": usage([item.body["prompt"]], [final])})
            else:
                yield event(error_object(502, "the worker's answer does not continue what "
                                              "was streamed"))
        yield "data: [DONE]\n\n"
        return


def _max_tokens(body: Any) -> int:
    """The ``max_tokens`` a batch item asked for (0 for an item that is no completion)."""
    value = body.get("max_tokens", 0) if isinstance(body, dict) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def check_batch(data: Any, served: Served, n: int, task_id: str = "",
                op: str | None = None, queue: str | None = None,
                max_tokens: list[int] | None = None) -> list[dict[str, Any]]:
    """A worker's answer to a batch of ``n`` items (task ``task_id``; ``op``: what the
    batch asked, the served op by default), checked item by item, each generated text
    no longer than its item's ``max_tokens`` (default: the served bound); with identity
    required, signed for that task by an active registered worker registered for
    ``queue``, the queue the batch was sent to."""
    op = op or served.op
    if not isinstance(data, dict) or set(data) - {"status", "outputs", "worker", "seconds",
                                                  "error", "signer", "sig"}:
        raise Refused(502, "the answer is not {status, outputs, worker, seconds}")
    if served.registry is not None:
        signer, sig, worker = data.get("signer"), data.get("sig"), data.get("worker")
        problem = identity.result_problem(
            data, signer if isinstance(signer, str) else None,
            sig if isinstance(sig, str) else None,
            worker if isinstance(worker, str) else "?", task_id, served.registry,
            None if queue is None else [queue])
        if problem:
            raise Refused(502, f"signature: {problem}")
    if data.get("status") != "ok":
        raise Refused(502, f"the worker says: {str(data.get('error'))[:300]}")
    outputs = data.get("outputs")
    if not isinstance(outputs, list) or len(outputs) != n:
        raise Refused(502, f"{len(outputs) if isinstance(outputs, list) else 'no'} outputs "
                      f"for {n} items")
    try:
        check_output(encode_rows(outputs), op, 0, n,
                     served.width or 0 if op == "embed" else served.classes,
                     max_tokens if max_tokens is not None else served.max_tokens)
    except FormatError as exc:
        raise Refused(502, str(exc)) from None
    return [{k: v for k, v in out.items() if k != "i"} for out in outputs]


def _flat(value: Any, out: list[float]) -> None:
    if isinstance(value, list):
        for v in value:
            _flat(v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value):
        out.append(float(value))
    else:
        raise ValueError(f"{str(value)[:40]!r} is not a finite number")


def parse_predict(body: Any, served: Served) -> list[list[float]]:
    """``{"inputs": [image, ...]}``, each image nested or flat, ``input_shape`` numbers."""
    size = math.prod(served.input_shape)
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or \
            set(body) != {"inputs"}:
        raise ValueError('expected {"inputs": [image, ...]}')
    images = body["inputs"]
    if not 0 < len(images) <= MAX_ITEMS_PER_REQUEST:
        raise ValueError(f"inputs: 1 to {MAX_ITEMS_PER_REQUEST} images")
    out = []
    for n, image in enumerate(images):
        flat: list[float] = []
        _flat(image, flat)
        if len(flat) != size:
            raise ValueError(f"inputs[{n}]: {len(flat)} numbers, the model takes {size} "
                             f"(shape {list(served.input_shape)})")
        out.append(flat)
    return out


#: The fields of OpenAI's completions request fedq takes (``user`` names the end user
#: and changes nothing); any other (``echo``, ``logprobs``, ``top_p``, ...) is refused
#: by name.
COMPLETION_FIELDS = ("prompt", "max_tokens", "temperature", "top_k", "seed", "model",
                     "stream", "stream_options", "n", "stop", "user")
MAX_N = 16
MAX_STOPS = 4  # OpenAI's bound on stop sequences


def parse_completion(body: Any, served: Served) -> list[dict[str, Any]]:
    """An OpenAI-style completion request: ``prompt`` (a string or a list of them),
    max_tokens, temperature, top_k, seed, ``n`` completions of each prompt (item k of a
    prompt samples with seed + k) and ``stream`` (read by the endpoint: not part of an
    item); ``stop`` is applied to the answers (:func:`parse_stops`). One item per
    prompt and completion, prompt by prompt."""
    if not isinstance(body, dict) or "prompt" not in body:
        raise ValueError('expected an object with a "prompt": a string or a list of strings')
    _check_fields(body, COMPLETION_FIELDS)
    if not isinstance(body.get("stream", False), bool):
        raise ValueError("stream: true or false")
    include_usage(body)
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ValueError(f"n: an integer in 1..{MAX_N}")
    if not prompts or len(prompts) * n > MAX_ITEMS_PER_REQUEST:
        raise ValueError(f"prompt: 1 or more strings, times n at most {MAX_ITEMS_PER_REQUEST}")
    for k, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise ValueError(f"prompt[{k}]: not a string")
        if len(prompt.encode()) > MAX_PROMPT_BYTES:
            raise ValueError(f"prompt[{k}]: more than {MAX_PROMPT_BYTES} bytes")
    stops = parse_stops(body)
    if body.get("stream") is True and (len(prompts) * n > 1 or stops):
        raise ValueError("stream: one prompt, n 1 and no stop")
    base = {"max_tokens": body.get("max_tokens", 16), "temperature": body.get("temperature", 1.0),
            "top_k": body.get("top_k", 0), "seed": body.get("seed", 0)}
    for key, lo, hi in (("max_tokens", 1, served.max_tokens), ("top_k", 0, 1_000_000),
                        ("seed", 0, 2**31 - n)):
        value = base[key]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"{key}: an integer in {lo}..{hi}")
    temp = base["temperature"]
    if not isinstance(temp, (int, float)) or isinstance(temp, bool) or not 0 < temp <= 10:
        raise ValueError("temperature: a number in (0, 10]")
    base["temperature"] = float(temp)
    return [{"prompt": prompt, **base, "seed": base["seed"] + k}
            for prompt in prompts for k in range(n)]


def include_usage(body: dict[str, Any]) -> bool:
    """A completion request's ``stream_options``: ``{"include_usage": true|false}``,
    with ``stream: true`` only (as OpenAI's API takes it); whether the stream ends with
    a usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if body.get("stream") is not True:
        raise ValueError("stream_options: only with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise ValueError('stream_options: {"include_usage": true or false}')
    return bool(options.get("include_usage", False))


def _check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """Refuse, by name, a field of OpenAI's request that fedq does not take (never
    ignored in silence); ``user`` (the end user's name) must be a string."""
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not supported by fedq serve (fields: "
                         f"{', '.join(allowed)})")
    if "user" in body and not isinstance(body["user"], str):
        raise ValueError("user: a string")


def parse_stops(body: dict[str, Any]) -> list[str]:
    """A completion request's ``stop``: a string or up to :data:`MAX_STOPS` of them."""
    stop = body.get("stop")
    if stop is None:
        return []
    stops = stop if isinstance(stop, list) else [stop]
    if len(stops) > MAX_STOPS or not all(isinstance(x, str) and 0 < len(x) <= 256
                                         for x in stops):
        raise ValueError(f"stop: a string or a list of at most {MAX_STOPS} non-empty strings")
    return stops


def stopped(text: str, stops: list[str]) -> tuple[str, str]:
    """``text`` cut before the first of ``stops`` in it, and its finish reason (``stop``
    where one was found, else ``length``)."""
    cut = min((i for i in (text.find(x) for x in stops) if i >= 0), default=-1)
    return (text[:cut], "stop") if cut >= 0 else (text, "length")


#: The fields of OpenAI's embeddings request fedq takes (``user`` names the end user
#: and changes nothing); any other is refused by name.
EMBEDDING_FIELDS = ("input", "model", "encoding_format", "user")


def parse_embeddings(body: Any, served: Served) -> list[str]:
    """An OpenAI-style embeddings request: ``input``, a string or a list of strings;
    ``encoding_format`` float (the default) or base64 (:func:`embedding_out` reads it
    from the request again)."""
    if not isinstance(body, dict) or "input" not in body:
        raise ValueError('expected {"input": "text" or ["text", ...]}')
    _check_fields(body, EMBEDDING_FIELDS)
    if body.get("encoding_format", "float") not in ("float", "base64"):
        raise ValueError("encoding_format: float or base64")
    texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
    if not 0 < len(texts) <= MAX_ITEMS_PER_REQUEST:
        raise ValueError(f"input: 1 to {MAX_ITEMS_PER_REQUEST} strings")
    for n, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"input[{n}]: not a string")
        if len(text.encode()) > MAX_PROMPT_BYTES:
            raise ValueError(f"input[{n}]: more than {MAX_PROMPT_BYTES} bytes")
    return texts


def usage(prompts: list[str], texts: list[str]) -> dict[str, int]:
    """OpenAI's ``usage`` of a completion request (each prompt counted once, every
    choice's text), in the byte-level model's tokens (bytes)."""
    n = sum(len(p.encode()) for p in prompts)
    m = sum(len(t.encode()) for t in texts)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def embedding_out(vector: list[float], encoding: str) -> list[float] | str:
    """One embedding as OpenAI's API returns it: a list of floats, or with
    ``encoding_format: base64`` the base64 of its little-endian float32 values."""
    if encoding != "base64":
        return vector
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.latency = Histogram("fedq_serve_request_seconds", "request latency", ["route"],
                                 registry=self.registry,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1,
                                          2.5, 5, 10, 30))
        self.batch = Histogram("fedq_serve_batch_size", "items per batch sent",
                               registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.pending = Gauge("fedq_serve_pending_items", "items waiting or out",
                             registry=self.registry)
        self.rejected = Counter("fedq_serve_rejected_total", "requests answered 503",
                                registry=self.registry)


def build_app(served: Served) -> Any:
    """The Starlette application."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    batcher = Batcher(served)
    try:
        batcher.metrics = _Metrics()
    except ImportError:  # prometheus-client (fedq[metrics]) not installed: no /metrics
        batcher.metrics = None
    # a language model also embeds: its own batches (one op a batch), the same bound
    embedder = Batcher(served, op="embed", metrics=batcher.metrics) \
        if served.width else None
    batchers = [b for b in (batcher, embedder) if b is not None]
    started = int(time.time())

    def error(status: int, message: str, **headers: str) -> JSONResponse:
        return JSONResponse(error_object(status, message), status_code=status,
                            headers=headers or None)

    def authorised(request: Request) -> bool:
        """The shared key (FEDQ_SERVE_API_KEY), or an active key of `fedq serve-key`;
        once either exists, nothing else passes."""
        from fedq.inference.keys import digest

        table = served.key_table
        if served.api_key is None and (table is None or not table.required):
            return True
        given = request.headers.get("authorization", "")
        if not given.startswith("Bearer "):
            return False
        token = given[len("Bearer "):]
        if served.api_key is not None and hmac.compare_digest(token.encode(),
                                                              served.api_key.encode()):
            return True
        return table is not None and digest(token) in table.active

    async def answer(request: Request, route: str, parse: Any, shape: Any,
                     via: Batcher = batcher, stream: Any = None) -> Response:
        """Parse, admit and wait; ``stream(item, start, include_usage)``: the response
        for a request that asked for a stream (its one item is queued with a stream of its
        own)."""
        start = time.perf_counter()
        if not authorised(request):
            return error(401, "missing or wrong API key (Authorization: Bearer KEY)")
        try:
            body = await read_json(request, served.body_limit, served.read_timeout_s)
            items = parse(body, served)
        except BadBody as exc:
            return error(exc.status, str(exc))
        except ValueError as exc:
            return error(400, str(exc))
        streamed = stream is not None and body.get("stream") is True
        bodies = items if isinstance(items, list) else [items]
        admitted = via.admit(bodies, stream=streamed)
        if admitted is None:
            if batcher.metrics is not None:
                batcher.metrics.rejected.inc()
            return error(503, f"busy: {via.pending} items waiting or out (at most "
                         f"{served.max_queue})", **{"Retry-After": "1"})
        if batcher.metrics is not None:
            batcher.metrics.pending.set(sum(b.pending for b in batchers))
        if streamed:
            return stream(admitted[0], start, include_usage(body))
        try:
            done = await asyncio.gather(*(item.future for item in admitted))
        except Refused as exc:
            return error(exc.status, str(exc))
        observe(route, start)
        return JSONResponse(shape(done))

    def observe(route: str, start: float) -> None:
        if batcher.metrics is not None:
            batcher.metrics.latency.labels(route).observe(time.perf_counter() - start)

    def completion_stream(item: _Item, start: float, with_usage: bool) -> Response:
        head = {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion",
                "created": int(time.time()), "model": served.name}

        async def events() -> AsyncIterator[str]:
            async for event in stream_events(item, head, with_usage):
                yield event
            observe("completions", start)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def predict(request: Request) -> Response:
        if served.op != "classify":
            return error(404, f"{served.name} is a language model: POST /v1/completions")
        return await answer(request, "predict", parse_predict, lambda done: {
            "model": served.name, "predictions": [out for out, _ in done],
            "batch_sizes": [n for _, n in done]})

    async def completions(request: Request) -> Response:
        if served.op != "generate":
            return error(404, f"{served.name} is a classifier: POST /v1/predict")
        asked: list[tuple[list[str], list[str]]] = []  # (each prompt once, stops)

        def parse(body: Any, s: Served) -> list[dict[str, Any]]:
            items = parse_completion(body, s)
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            asked.append((prompts, parse_stops(body)))
            return items

        def shape(done: list[tuple[dict[str, Any], int]]) -> dict[str, Any]:
            prompts, stops = asked[0]
            texts, choices = [], []
            for k, (out, _) in enumerate(done):
                text, finish = stopped(out["text"], stops)
                texts.append(text)
                choices.append({"text": text, "index": k, "logprobs": None,
                                "finish_reason": finish})
            return {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion",
                    "created": int(time.time()), "model": served.name, "choices": choices,
                    "usage": usage(prompts, texts), "batch_size": done[0][1]}

        return await answer(request, "completions", parse, shape, stream=completion_stream)

    async def embeddings(request: Request) -> Response:
        if embedder is None:
            return error(404, f"{served.name} is a classifier: POST /v1/predict")
        encoding: list[str] = []

        def parse(body: Any, s: Served) -> list[str]:
            texts = parse_embeddings(body, s)
            encoding.append(body.get("encoding_format", "float"))
            tokens.append(sum(len(t.encode()) for t in texts))  # a byte a token
            return texts

        tokens: list[int] = []
        return await answer(request, "embeddings", parse, lambda done: {
            "object": "list", "model": served.name,
            "data": [{"object": "embedding", "index": k,
                      "embedding": embedding_out(out["embedding"], encoding[0])}
                     for k, (out, _) in enumerate(done)],
            "usage": {"prompt_tokens": tokens[0], "total_tokens": tokens[0]},
            "batch_sizes": [n for _, n in done]}, embedder)

    async def models(request: Request) -> Response:
        if not authorised(request):
            return error(401, "missing or wrong API key (Authorization: Bearer KEY)")
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": started, "owned_by": "fedq"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": served.name, "op": served.op,
                             "queue": batcher.router.best() if batcher.router
                             else served.queues[0],
                             "routes": batcher.router.to_json() if batcher.router else {},
                             "pending": sum(b.pending for b in batchers),
                             # how answers are found: notices of stored states, or polls
                             "results": "notified" if batcher.watch else "polled",
                             "notices": batcher.watch.heard if batcher.watch else 0,
                             # answers and stream pieces taken from a notice (no GET)
                             "from_notices": sum(b.from_notices for b in batchers)})

    async def metrics(request: Request) -> Response:
        if not authorised(request):
            return error(401, "missing or wrong API key (Authorization: Bearer KEY)")
        if batcher.metrics is None:
            return error(501, "metrics need prometheus-client: pip install 'fedq[metrics]'")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        batcher.metrics.pending.set(sum(b.pending for b in batchers))
        return Response(generate_latest(batcher.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(application: Any) -> AsyncIterator[None]:
        collectors = [asyncio.get_running_loop().create_task(b.run()) for b in batchers]
        watch = result_watch(str(app.conf.result_backend or "").split("+", 1)[-1])
        if watch is not None:
            try:
                await watch.start()
            except Exception as exc:  # noqa: BLE001 - polling works without it
                log.warning("fedq serve: no result notices (%s); polling", exc)
                await watch.close()
                watch = None
        if watch is not None:
            collectors.append(asyncio.get_running_loop().create_task(watch.listen()))
            for b in batchers:
                b.watch = watch

        def read_keys() -> None:
            if served.read_key_table is None:
                return
            try:
                served.key_table = served.read_key_table()
            except Exception as exc:  # noqa: BLE001 - the database away: keep the last
                log.warning("fedq serve: could not read the API keys: %s", exc)

        def routes() -> None:
            last = 0.0
            while True:
                if time.monotonic() - last >= ROUTE_EVERY_S:
                    last = time.monotonic()
                    batcher.reroute()
                    for other in batchers[1:]:
                        assert other.router is not None and batcher.router is not None
                        other.router.live = dict(batcher.router.live)
                        other.router.slots = dict(batcher.router.slots)
                read_keys()
                time.sleep(KEYS_EVERY_S)

        if served.read_key_table is not None and served.key_table is None:
            from fedq.inference.keys import Keys

            served.key_table = Keys(True, frozenset())  # closed until the table is read
        await asyncio.to_thread(read_keys)  # before the first request

        threading.Thread(target=routes, name="fedq-serve-route", daemon=True).start()
        yield
        for collector in collectors:
            collector.cancel()
        if watch is not None:
            await watch.close()

    application = Starlette(routes=[
        Route("/v1/predict", predict, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health), Route("/metrics", metrics)], lifespan=lifespan)
    application.state.batcher = batcher
    return application


def prepare(settings: Any, src: Any, base: Any, queues: list[str], **options: Any) -> Served:
    """What to serve: the model of ``src`` (a ModelSource) checked to build, its weights
    in the blob store where the workers read them. With FEDQ_IDENTITY=required,
    ``options`` carries ``read_registry`` (the caller's reader of the registered
    workers), and the batches are sealed with the coordinator's keys."""
    import torch

    from fedq.blobs import store_for
    from fedq.data import load_dataset
    from fedq.db.session import ensure_schema
    from fedq.engine.broker import check_broker
    from fedq.errors import FedqError, SpecError
    from fedq.inference.jobs import byte_level, model_source
    from fedq.inference.run import load_model
    from fedq.protocol.inference import model_key
    from fedq.weights import loads

    check_broker()
    store = store_for(settings)
    store.check()
    # its API keys live in the database, as a job's model does: the embedded default is
    # migrated here (another database names `fedq db upgrade` in one line)
    ensure_schema(settings.database_url)
    arch, blob, data = model_source(settings, src, base)
    ds = load_dataset(arch["dataset"], None, arch["dataset_args"])
    byte_level(ds, arch)
    if data is not None:
        try:
            load_model(arch, loads(data, what=str(src.weights)), torch.device("cpu"))
        except (FedqError, TypeError, ValueError, RuntimeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise SpecError(f"--weights: {src.weights} is not a {arch['name']} for "
                            f"{arch['dataset']}: {first[:300]}") from None
        blob = store.put(model_key(f"serve-{uuid.uuid4().hex[:12]}"), data)
    assert blob is not None
    name = src.job if src.job not in (None, "latest") else \
        (blob.key.split("/")[1] if src.job == "latest" else str(src.weights))
    if settings.identity == "required":
        if options.get("read_registry") is None:
            raise FedqError("FEDQ_IDENTITY=required: fedq serve needs the registered "
                            "workers (run it where the coordinator's database is)")
        identity.coordinator_key(settings.keys_dir)  # its keys: made, or a clear error
        options = {**options, "keys": settings.keys_dir,
                   "registry": options["read_registry"]()}
    else:
        options = {**options, "read_registry": None}
    from fedq.inference.jobs import embedding_width

    try:
        width = embedding_width(arch) if ds.is_text else None
    except SpecError:  # a language model without embeddings: no /v1/embeddings
        width = None
    return Served(name=str(name), op="generate" if ds.is_text else "classify",
                  model=blob.to_json(), arch=arch, classes=ds.num_classes, width=width,
                  input_shape=tuple(ds.input_shape), queues=queues, **options)


def run(served: Served, host: str, port: int) -> None:
    import uvicorn

    # No task-sent event per batch: a second publish on each request's path. The
    # dashboard would list every batch; the gateway's /metrics counts them instead.
    app.conf.task_send_sent_event = False

    uvicorn.run(build_app(served), host=host, port=port, log_level="warning")
