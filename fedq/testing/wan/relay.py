"""The user-space relay that adds latency, jitter and stalls (this kernel has no
``netem``): one asyncio TCP proxy per host and service, each chunk held half the round
trip in each direction, in order."""

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
CHUNK = 64 << 10
_QUEUE_BYTES = 8 << 20  # per direction: well above the largest bandwidth-delay product


@dataclass
class RelayStats:
    down: int = 0  # bytes target -> client
    up: int = 0
    connections: int = 0
    stalls: int = 0


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
        self._writers: set[asyncio.StreamWriter] = set()
        self._rnd = random.Random(port)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.listen, self.port,
                                                  reuse_address=True)
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self.refuse_until:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.stats.connections += 1
        self._writers |= {writer, up_w}
        pumps = [asyncio.create_task(self._pump(reader, up_w, "up")),
                 asyncio.create_task(self._pump(up_r, writer, "down"))]
        done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        if pending and not any(t.exception() for t in done):  # a clean half-close
            await asyncio.wait(pending)
        for task in pumps:
            task.cancel()
        for w in (writer, up_w):
            self._writers.discard(w)
            w.transport.abort()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    direction: str) -> None:
        queue: deque[tuple[float, bytes]] = deque()
        queued = [0]
        ready = asyncio.Event()
        room = asyncio.Event()
        room.set()
        done = [False]

        async def deliver() -> None:
            while True:
                while not queue:
                    if done[0]:
                        return
                    ready.clear()
                    await ready.wait()
                at, data = queue.popleft()
                queued[0] -= len(data)
                room.set()
                wait = at - time.monotonic()
                if wait > 0.0005:  # epoll waits whole milliseconds: finer is not kept
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()
                setattr(self.stats, direction, getattr(self.stats, direction) + len(data))

        sender = asyncio.create_task(deliver())
        last = 0.0
        try:
            while True:
                data = await src.read(CHUNK)
                if not data:
                    break
                link = self.link
                delay = link.rtt_ms / 2000
                if link.jitter_ms:
                    delay += self._rnd.uniform(-link.jitter_ms, link.jitter_ms) / 1000
                if link.stall and self._rnd.random() < link.stall:
                    delay += RTO_S + link.rtt_ms / 1000
                    self.stats.stalls += 1
                last = max(last, time.monotonic() + max(0.0, delay))
                queue.append((last, data))
                queued[0] += len(data)
                ready.set()
                if queued[0] > _QUEUE_BYTES:
                    room.clear()
                    await room.wait()
            done[0] = True
            ready.set()
            await sender
            if dst.can_write_eof():
                dst.write_eof()
        finally:
            sender.cancel()

    def reset(self, refuse_s: float = 0.0) -> None:
        """Close every connection through this relay now; refuse new ones for
        ``refuse_s`` seconds."""
        def go() -> None:
            self.refuse_until = time.monotonic() + refuse_s
            for w in list(self._writers):
                w.transport.abort()
            self._writers.clear()
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
