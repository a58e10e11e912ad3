"""Staleness weights for buffered asynchronous aggregation (FedBuff, Nguyen et al.,
AISTATS 2022, arXiv:2106.06639, section 3 and appendix).

An update trained from model version ``b`` and applied to build version ``v`` has
staleness ``tau = (v - 1) - b``: how many versions were committed while it trained.
Its weight in the buffer's mean is ``samples x s(tau)``, normalised by the sum of the
weights (never by the buffer size K: with staleness factors below 1, dividing by K
would shrink every step).

- ``constant``:   s(tau) = 1
- ``polynomial``: s(tau) = (1 + tau) ** -a              (FedBuff's choice, a = 0.5)
- ``hinge``:      s(tau) = 1 if tau <= b else 1 / (a (tau - b) + 1)
"""

from __future__ import annotations


def staleness_factor(kind: str, tau: int, *, a: float = 0.5, b: int = 10) -> float:
    """s(tau) for ``kind``; tau < 0 is an error (an update from the future)."""
    if tau < 0:
        raise ValueError(f"staleness {tau} < 0")
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((1.0 + tau) ** -a)
    if kind == "hinge":
        return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)
    raise ValueError(f"unknown staleness kind {kind!r}")
