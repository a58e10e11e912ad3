"""Checking the emulator: a sink/echo server here and a probe run inside a host's
namespace (``python -m fedq.testing.wan.probe``) that measures its round trip and
throughput each way."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from fedq.errors import FedqError
from fedq.testing.wan.hosts import Host
from fedq.testing.wan.relay import CHUNK


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
                        left -= len(f.read(min(left, CHUNK)) or b"x" * left)
                    conn.sendall(b"u")
                elif cmd == b"D":
                    block = b"\0" * CHUNK
                    left = n
                    while left:
                        conn.sendall(block[:min(left, CHUNK)])
                        left -= min(left, CHUNK)

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
    """Measure the emulated link from inside ``host``: median and shortest RTT (ms,
    ``rtt_ms``, ``rtt_min_ms``) of ``pings`` one-byte round trips, and up/down
    throughput (Mbit/s) of bulk transfers."""
    proc = subprocess.run(
        [*host.exec_prefix(), sys.executable, "-m", "fedq.testing.wan.probe",
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
    block = b"\0" * CHUNK
    left = up
    while left:
        conn.sendall(block[:min(left, CHUNK)])
        left -= min(left, CHUNK)
    f.read(1)
    up_s = time.perf_counter() - t - rtt
    t = time.perf_counter()
    conn.sendall(b"D%d\n" % down)
    left = down
    while left:
        left -= len(f.read(min(left, CHUNK)))
    down_s = time.perf_counter() - t - rtt
    print(json.dumps({"rtt_ms": rtt * 1000, "rtt_min_ms": rtts[0] * 1000,
                      "up_mbit": up * 8 / up_s / 1e6,
                      "down_mbit": down * 8 / down_s / 1e6}))


if __name__ == "__main__":
    _probe_main(sys.argv[1:])
