"""Requests collected into batches, each sent as one ``fedq.serve_batch`` task and
its answer handed back to the requests (:class:`Batcher`)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import fedq.identity as identity
from fedq.engine.app import app
from fedq.engine.names import SERVE_TASK, STREAM_STATE, TRAINING_QUEUES
from fedq.protocol.envelope import MESSAGE_FORMAT
from fedq.redaction import redact_text
from fedq.serve.results import (
    ResultWatch,
    _Item,
    _max_tokens,
    _pass_on,
    check_batch,
    read_state,
    stream_texts,
)
from fedq.serve.router import Router
from fedq.serve.served import SEND_GRACE_S, Refused, Served, answer_bytes

log = logging.getLogger(__name__)


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
        bound = answer_bytes(self.op, len(batch), max(map(_max_tokens, (
            item.body for item in batch)), default=0), s.token_chars)
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
                                                 queue, s.token_chars))
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
