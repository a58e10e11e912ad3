"""The user-space relay that adds latency, jitter and stalls (this kernel has no
``netem``): one asyncio TCP proxy per host and service, each chunk held half the round
trip in each direction, in order.

It is written with asyncio's protocols, not its streams: a chunk read is written on
from the read callback itself (or from one timer per direction when the link holds
it), with no task switch or queue between them, which costs less CPU per byte relayed
than streams (docs/wan.md, "How the emulation works", measures both)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from dataclasses import dataclass

from fedq.testing.wan.profiles import Profile

#: One retransmission timeout: Linux's minimum RTO (TCP_RTO_MIN, 200 ms).
RTO_S = 0.2
CHUNK = 64 << 10  # the link probe's reads and writes (fedq/testing/wan/probe.py)
#: A chunk due this soon is written at once: epoll waits whole milliseconds.
_NOW_S = 0.0005
_QUEUE_BYTES = 8 << 20  # per direction: well above the largest bandwidth-delay product


@dataclass
class RelayStats:
    down: int = 0  # bytes target -> client
    up: int = 0
    connections: int = 0
    stalls: int = 0


_OTHER = {"up": "down", "down": "up"}


class _Side(asyncio.Protocol):
    """One socket of a relayed connection; what it reads goes to the other side."""

    def __init__(self, conn: "_Conn", direction: str) -> None:
        self.conn, self.direction = conn, direction  # the direction of the bytes it reads
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.conn.made(self)

    def data_received(self, data: bytes) -> None:
        self.conn.forward(self.direction, data)

    def eof_received(self) -> bool:
        self.conn.forward(self.direction, b"")
        return True  # half-closed: the other way may still carry bytes

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.close()

    def pause_writing(self) -> None:  # its peer's bytes fill its socket: stop reading them
        self.conn.hold(_OTHER[self.direction], "writing", True)

    def resume_writing(self) -> None:
        self.conn.hold(_OTHER[self.direction], "writing", False)


class _Conn:
    """A client's connection and the relay's own to the target: each direction's
    chunks held by the link's delay, in order; an end of file passed on after the
    bytes before it; torn down when both ways have ended or either socket fails."""

    def __init__(self, relay: "Relay") -> None:
        self.relay = relay
        self.loop = asyncio.get_running_loop()
        self.client = _Side(self, "up")
        self.target = _Side(self, "down")
        self.queue: dict[str, deque[tuple[float, bytes]]] = {"up": deque(), "down": deque()}
        self.queued = {"up": 0, "down": 0}
        self.last = {"up": 0.0, "down": 0.0}
        self.timer: dict[str, asyncio.TimerHandle | None] = {"up": None, "down": None}
        self.ended = {"up": False, "down": False}
        self.held: dict[str, set[str]] = {"up": set(), "down": set()}
        self.closed = False
        self.connecting: asyncio.Task[None] | None = None

    def made(self, side: _Side) -> None:
        transport = side.transport
        assert transport is not None
        if self.closed or (side is self.client and time.monotonic() < self.relay.refuse_until):
            transport.abort()  # refused, or the client left while the target answered
            return
        self.relay._transports.add(transport)
        if side is self.client:
            self.hold("up", "target", True)  # until the target answers
            self.connecting = self.loop.create_task(self._connect())  # kept: the loop
            # holds a task only weakly

    async def _connect(self) -> None:
        relay = self.relay
        try:
            await self.loop.create_connection(lambda: self.target, relay.target_host,
                                              relay.target_port)
        except OSError:
            self.close()
            return
        if not self.closed:
            relay.stats.connections += 1
            self.hold("up", "target", False)

    def _ends(self, direction: str) -> tuple[_Side, _Side]:
        """(reads, writes) of ``direction``."""
        return (self.client, self.target) if direction == "up" else (self.target, self.client)

    def hold(self, direction: str, why: str, on: bool) -> None:
        """Pause or resume reading the source of ``direction`` for ``why``."""
        src = self._ends(direction)[0].transport
        held = self.held[direction]
        was = bool(held)
        if on:
            held.add(why)
        else:
            held.discard(why)
        if src is None or src.is_closing() or was == bool(held):
            return
        if held:
            src.pause_reading()
        else:
            src.resume_reading()

    def forward(self, direction: str, data: bytes) -> None:
        """A chunk read (``b""``: the end of the file), to be written at its time."""
        link, rnd = self.relay.link, self.relay._rnd
        now = self.loop.time()
        delay = link.rtt_ms / 2000
        if link.jitter_ms:
            delay += rnd.uniform(-link.jitter_ms, link.jitter_ms) / 1000
        if data and link.stall and rnd.random() < link.stall:
            delay += RTO_S + link.rtt_ms / 1000
            self.relay.stats.stalls += 1
        due = self.last[direction] = max(self.last[direction], now + max(0.0, delay))
        queue = self.queue[direction]
        if not queue and due - now <= _NOW_S:
            self._write(direction, data)
            return
        queue.append((due, data))
        self.queued[direction] += len(data)
        if self.queued[direction] > _QUEUE_BYTES:
            self.hold(direction, "queue", True)
        if self.timer[direction] is None:
            self.timer[direction] = self.loop.call_at(due, self._flush, direction)

    def _flush(self, direction: str) -> None:
        self.timer[direction] = None
        queue = self.queue[direction]
        now = self.loop.time()
        while queue and queue[0][0] - now <= _NOW_S:
            _, data = queue.popleft()
            self.queued[direction] -= len(data)
            self._write(direction, data)
        if queue:
            self.timer[direction] = self.loop.call_at(queue[0][0], self._flush, direction)
        if self.queued[direction] <= _QUEUE_BYTES:
            self.hold(direction, "queue", False)

    def _write(self, direction: str, data: bytes) -> None:
        dst = self._ends(direction)[1].transport
        if self.closed or dst is None or dst.is_closing():
            return
        if data:
            dst.write(data)
            setattr(self.relay.stats, direction, getattr(self.relay.stats, direction) + len(data))
            return
        self.ended[direction] = True
        try:
            if dst.can_write_eof():
                dst.write_eof()
        except OSError:  # the other end is gone already (ENOTCONN): nothing to end
            self.close()
            return
        if all(self.ended.values()):
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for direction, timer in self.timer.items():
            if timer is not None:
                timer.cancel()
            self.timer[direction] = None
        for side in (self.client, self.target):
            if side.transport is not None:
                self.relay._transports.discard(side.transport)
                side.transport.abort()


class Relay:
    """One listening proxy: client <-> target, each chunk held rtt/2 (+ jitter, + an
    RTO with probability ``stall``)."""

    def __init__(self, relays: "Relays", listen: str, port: int, target_host: str,
                 target_port: int, link: Profile) -> None:
        self.relays, self.listen, self.port = relays, listen, port
        self.target_host, self.target_port, self.link = target_host, target_port, link
        self.stats = RelayStats()
        self.refuse_until = 0.0
        self._server: asyncio.base_events.Server | None = None
        self._transports: set[asyncio.Transport] = set()
        self._rnd = random.Random(port)

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self).client, self.listen,
                                                self.port, reuse_address=True)
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]

    def reset(self, refuse_s: float = 0.0) -> None:
        """Close every connection through this relay now; refuse new ones for
        ``refuse_s`` seconds."""
        def go() -> None:
            self.refuse_until = time.monotonic() + refuse_s
            for t in list(self._transports):
                t.abort()
            self._transports.clear()
        self.relays.call(go)

    def close(self) -> None:
        if self._server is not None:
            server = self._server
            self.relays.call(server.close)
            self._server = None
        self.reset()


class Relays:
    """The proxies of a run, on one event loop in a thread of this process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._cpu = [0.0]
        self.thread = threading.Thread(target=self._run, name="fedq-wan-relays",
                                       daemon=True)
        self.thread.start()
        self.relays: list[Relay] = []

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, fn: object) -> None:
        self.loop.call_soon_threadsafe(fn)  # type: ignore[arg-type]

    def add(self, listen: str, port: int, target_host: str, target_port: int,
            link: Profile) -> Relay:
        relay = Relay(self, listen, port, target_host, target_port, link)
        asyncio.run_coroutine_threadsafe(relay._start(), self.loop).result(10)
        self.relays.append(relay)
        return relay

    def cpu_seconds(self) -> float:
        """CPU time the relay thread has used so far."""
        async def read() -> float:
            return time.thread_time()
        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)

    def close(self) -> None:
        for relay in self.relays:
            relay.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
