"""A host with its own address: a Linux network namespace joined to this one by a
veth pair, its links shaped by ``tbf``, cut and restored (needs root)."""

from __future__ import annotations

import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedq.errors import FedqError
from fedq.testing.wan.profiles import Profile
from fedq.testing.wan.relay import Relay, Relays


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
