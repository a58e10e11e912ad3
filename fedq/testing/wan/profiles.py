"""A link's shape: bandwidth each way, round trip, jitter and stalls, and the
presets the tests and bench/wan.py use (their sources in :attr:`Profile.source`)."""

from __future__ import annotations

from dataclasses import dataclass

from fedq.errors import FedqError


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
