"""`fedq doctor`'s checks of this machine, as a library the CLI only prints: the
hardware class, the torch build against the GPUs (and, inside a fedq image, against
fedq/pins.toml), the owner's run policy with what each of its probes can read here
(fedq/worker/owner.py), and with ``services`` the broker and a 10 MB blob each way."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fedq.errors import ConfigError
from fedq.settings import Settings
from fedq.worker.hardware import HardwareReport, diagnose, image_problems, pins, probe
from fedq.worker.owner import Policy, Watch, describe, probes


@dataclass
class Checkup:
    report: HardwareReport
    problems: list[str]  # one line each, with the fix; empty: this machine can train
    image: dict[str, Any] | None  # inside a fedq image: its class, pins and problems
    links: dict[str, Any] | None  # with services: the broker and blob store timings
    owner: dict[str, Any] | None = None  # the run policy, its verdict now, its probes


def checkup(settings: Settings, services: bool = False) -> Checkup:
    """Check this machine (and with ``services`` its links to the coordinator's
    broker and blob store, as this shell's FEDQ_* settings name them)."""
    report = probe()
    problems = diagnose(report)
    image: dict[str, Any] | None = None
    if settings.image_class:  # inside a fedq image: its torch vs the pins
        cls = settings.image_class
        image = {"class": cls, "pins": pins().get(cls), "torch_from": settings.image_torch,
                 "problems": image_problems(report, cls, source=settings.image_torch)}
        problems += [f"image {cls}: {p}" for p in image["problems"]]
    links: dict[str, Any] | None = None
    if services:
        from fedq.worker.links import check_services

        links = check_services(settings)
        problems += links["problems"]
    owner: dict[str, Any] | None = None
    try:
        policy = Policy.from_settings(settings)
    except ConfigError as exc:
        problems.append(str(exc))
    else:
        owner = {"policy": describe(policy),
                 "now": Watch(policy).check() if policy.active else None,
                 "probes": [dataclasses.asdict(p) for p in probes(policy)]}
    return Checkup(report, problems, image, links, owner)
