"""Hosts with their own addresses over emulated wide-area links (tests and bench/wan.py).

A :class:`Host` is a Linux network namespace joined to this one by a veth pair: its
own interface and address (``10.A.B.2``), reaching the coordinator's services only
through that link. A :class:`Profile` shapes its link:

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

The pieces: profiles.py (link shapes and presets), hosts.py (namespaces, veth, tbf,
cuts), relay.py (the latency proxy), probe.py (measuring an emulated link).
"""

from fedq.testing.wan.hosts import Host, have_netns, tbf
from fedq.testing.wan.probe import probe, serve_probe_target
from fedq.testing.wan.profiles import PRESETS, Profile, profile
from fedq.testing.wan.relay import RTO_S, Relay, Relays, RelayStats

__all__ = ["PRESETS", "RTO_S", "Host", "Profile", "Relay", "RelayStats", "Relays",
           "have_netns", "probe", "profile", "serve_probe_target", "tbf"]
