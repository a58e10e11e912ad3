"""Hosts with their own addresses over emulated wide-area links (tests and bench/wan.py).

A :class:`Host` is a Linux network namespace joined to this one by a veth pair: its
own interface and address (``10.A.B.2``), reaching the coordinator's services only
through that link. A :class:`Link` shapes it:

- bandwidth: the kernel's ``tbf`` qdisc on each end of the veth pair (the host-side
  end caps the uplink, the root-side end the downlink);
- latency, jitter and loss-as-stalls: this kernel has no ``netem``, so a small asyncio
  TCP proxy per host and service (:class:`Relay`) holds each chunk for half the round
  trip in each direction, in order, and with probability ``stall`` per chunk holds it
  one retransmission timeout longer (how a lost segment looks to the application);
- partitions: :meth:`Host.cut` takes the veth pair down (packets dropped, TCP
  retransmits, nothing is reset) until :meth:`Host.restore`; :meth:`Relay.reset`
  closes every connection and refuses new ones for a while (a NAT or Wi-Fi reconnect).

What the proxy cannot do: the worker's TCP connection ends at the proxy, so TCP's own
slow start and loss recovery see a short round trip; the emulation is optimistic for
the first round trips of a new connection (docs/wan.md measures the rest).

Needs root (``ip netns``, ``tc``). Nothing here is used by fedq at run time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedq.errors import FedqError

#: One retransmission timeout: Linux's minimum RTO (TCP_RTO_MIN, 200 ms).
RTO_S = 0.2
_CHUNK = 64 << 10
_QUEUE_BYTES = 8 << 20  # per direction: well above the largest bandwidth-delay product


@dataclass(frozen=True)
class Profile:
    """A network path between a host and the coordinator."""

    name: str
    down_mbit: float  # coordinator -> host
    up_mbit: float  # host -> coordinator
    rtt_ms: float
    jitter_ms: float = 0.0  # +- uniform, per chunk, order kept
    stall: float = 0.0  # probability per chunk of one extra RTO
    source: str = ""

    def describe(self) -> str:
        rate = (f"{self.down_mbit:g} Mbit/s" if self.down_mbit == self.up_mbit
                else f"{self.up_mbit:g} Mbit/s up / {self.down_mbit:g} down")
        extra = (f", jitter ±{self.jitter_ms:g} ms" if self.jitter_ms else "") + \
            (f", {self.stall:.0%} stalls" if self.stall else "")
        return f"{rate}, {self.rtt_ms:g} ms RTT{extra}"


#: The presets of issue 12, with where their numbers come from.
PRESETS: dict[str, Profile] = {p.name: p for p in (
    Profile("lan", 1000, 1000, 0.2,
            source="gigabit Ethernet, one switch (typical ping 0.1-0.3 ms)"),
    Profile("metro", 1000, 1000, 10,
            source="two sites in one metro area on fibre (~10 ms)"),
    Profile("wan", 100, 100, 50, jitter_ms=5,
            source="cross-country research link share (50 ms ~ 5000 km of fibre)"),
    Profile("home", 100, 20, 30,
            source="cable/DSL home line: asymmetric 100/20 Mbit/s, 30 ms to a cloud region"),
    Profile("constrained", 10, 10, 200, stall=0.01,
            source="satellite or congested mobile link: 10 Mbit/s, 200 ms, 1% loss"),
)}


def profile(name: str) -> Profile:
    try:
        return PRESETS[name]
    except KeyError:
        raise FedqError(f"unknown WAN preset {name!r} (known: {', '.join(PRESETS)})") from None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise FedqError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")


def tbf(dev: str, mbit: float, ns: str | None = None) -> None:
    """Cap ``dev``'s egress at ``mbit`` with tbf. The bucket holds 10 ms at that rate
    (at least 64 KiB, one GSO segment), the queue 200 ms."""
    burst = max(64 << 10, int(mbit * 1e6 / 8 * 0.01))
    _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit",
        "burst", str(burst), "latency", "200ms", ns=ns)


def have_netns() -> str | None:
    """None when namespaces and tbf can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"fqprobe{os.getpid()}"
    try:
        _ip("ip", "netns", "add", name)
    except (FedqError, OSError) as exc:
        return str(exc)
    try:
        _ip("ip", "link", "set", "lo", "up", ns=name)
        _ip("tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", "1mbit", "burst",
            "64kb", "latency", "50ms", ns=name)
    except FedqError as exc:
        return str(exc)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
    return None


def _subnet() -> tuple[int, int]:
    """A 10.A.B.0/24 unused on this machine (parallel test processes pick apart)."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True,
                          check=False).stdout
    rnd = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        a, b = rnd.randrange(100, 250), rnd.randrange(1, 250)
        if f" 10.{a}.{b}." not in used:
            return a, b
    raise FedqError("no free 10.A.B.0/24 subnet for a WAN host")


@dataclass
class Host:
    """A network namespace with one veth link to this namespace."""

    name: str
    link: Profile
    ns: str = ""
    root_ip: str = ""
    ip: str = ""
    relays: list["Relay"] = field(default_factory=list)

    def __post_init__(self) -> None:
        tag = f"{os.getpid() % 100000}{self.name}"[-9:]
        self.ns, self.root_dev, self.host_dev = f"fq{tag}", f"fq{tag}r", f"fq{tag}h"

    def create(self) -> "Host":
        a, b = _subnet()
        self.root_ip, self.ip = f"10.{a}.{b}.1", f"10.{a}.{b}.2"
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, check=False)
        _ip("ip", "netns", "add", self.ns)
        try:
            _ip("ip", "link", "add", self.root_dev, "type", "veth", "peer", "name",
                self.host_dev)
            _ip("ip", "link", "set", self.host_dev, "netns", self.ns)
            _ip("ip", "addr", "add", f"{self.root_ip}/24", "dev", self.root_dev)
            _ip("ip", "link", "set", self.root_dev, "up")
            _ip("ip", "addr", "add", f"{self.ip}/24", "dev", self.host_dev, ns=self.ns)
            _ip("ip", "link", "set", self.host_dev, "up", ns=self.ns)
            _ip("ip", "link", "set", "lo", "up", ns=self.ns)
            self.shape(self.link)
        except BaseException:
            self.destroy()
            raise
        return self

    def shape(self, link: Profile) -> None:
        """Apply ``link``'s rates (and, to this host's relays, its delays)."""
        self.link = link
        tbf(self.root_dev, link.down_mbit)
        tbf(self.host_dev, link.up_mbit, ns=self.ns)
        for relay in self.relays:
            relay.link = link

    def destroy(self) -> None:
        for relay in self.relays:
            relay.close()
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.root_dev], capture_output=True,
                       check=False)

    def cut(self) -> None:
        """Take the link down: packets are dropped both ways, connections stay open."""
        _ip("ip", "link", "set", self.root_dev, "down")

    def restore(self) -> None:
        _ip("ip", "link", "set", self.root_dev, "up")

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def bytes(self) -> tuple[int, int]:
        """(bytes down, bytes up) that crossed the link so far (kernel counters)."""
        stats = Path(f"/sys/class/net/{self.root_dev}/statistics")
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())

    def forward(self, relays: "Relays", target_port: int, port: int | None = None,
                target_host: str = "127.0.0.1") -> "Relay":
        """A relay on this host's link address to ``target_host:target_port``; the
        host reaches the service at ``self.root_ip:port`` (``port`` 0: any free one;
        default: the service's own port)."""
        relay = relays.add(self.root_ip, target_port if port is None else port, target_host,
                           target_port, self.link)
        self.relays.append(relay)
        return relay

    def url(self, url: str, relay: "Relay") -> str:
        """``url`` rewritten to reach its service through ``relay``."""
        host_port = f"{relay.target_host}:{relay.target_port}"
        if host_port not in url:
            raise FedqError(f"{url} does not name {host_port}")
        return url.replace(host_port, f"{self.root_ip}:{relay.port}")


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
                data = await src.read(_CHUNK)
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


# --- emulator check: a sink/echo server here, a probe in the host's namespace --------

def serve_probe_target() -> tuple[socket.socket, threading.Thread]:
    """A TCP server on 127.0.0.1: 'P' echoes one byte, 'U<n>' reads n bytes then
    answers, 'D<n>' sends n bytes."""
    server = socket.create_server(("127.0.0.1", 0))

    def handle(conn: socket.socket) -> None:
        with conn:
            f = conn.makefile("rb")
            while True:
                line = f.readline()
                if not line:
                    return
                cmd, n = line[:1], int(line[1:].strip() or 0)
                if cmd == b"P":
                    conn.sendall(b"p")
                elif cmd == b"U":
                    left = n
                    while left:
                        left -= len(f.read(min(left, _CHUNK)) or b"x" * left)
                    conn.sendall(b"u")
                elif cmd == b"D":
                    block = b"\0" * _CHUNK
                    left = n
                    while left:
                        conn.sendall(block[:min(left, _CHUNK)])
                        left -= min(left, _CHUNK)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return server, thread


def probe(host: Host, port: int, nbytes_up: int, nbytes_down: int,
          pings: int = 20) -> dict[str, float]:
    """Measure the emulated link from inside ``host``: median RTT (ms) of ``pings``
    one-byte round trips, and up/down throughput (Mbit/s) of bulk transfers."""
    proc = subprocess.run(
        [*host.exec_prefix(), sys.executable, "-m", "fedq.testing.wan", "probe",
         host.root_ip, str(port), str(nbytes_up), str(nbytes_down), str(pings)],
        capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise FedqError(f"probe in {host.ns} failed: {proc.stderr.strip()[-500:]}")
    result: dict[str, float] = json.loads(proc.stdout)
    return result


def _probe_main(argv: Sequence[str]) -> None:
    ip, port, up, down, pings = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), \
        int(argv[4])
    conn = socket.create_connection((ip, port), timeout=120)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = conn.makefile("rb")
    rtts = []
    for _ in range(pings + 1):
        t = time.perf_counter()
        conn.sendall(b"P\n")
        f.read(1)
        rtts.append(time.perf_counter() - t)
    rtts = sorted(rtts[1:])
    # throughput: time from the first byte sent to the answer, less one round trip
    rtt = rtts[len(rtts) // 2]
    t = time.perf_counter()
    conn.sendall(b"U%d\n" % up)
    block = b"\0" * _CHUNK
    left = up
    while left:
        conn.sendall(block[:min(left, _CHUNK)])
        left -= min(left, _CHUNK)
    f.read(1)
    up_s = time.perf_counter() - t - rtt
    t = time.perf_counter()
    conn.sendall(b"D%d\n" % down)
    left = down
    while left:
        left -= len(f.read(min(left, _CHUNK)))
    down_s = time.perf_counter() - t - rtt
    print(json.dumps({"rtt_ms": rtt * 1000, "up_mbit": up * 8 / up_s / 1e6,
                      "down_mbit": down * 8 / down_s / 1e6}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        _probe_main(sys.argv[2:])
