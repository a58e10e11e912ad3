"""The worker registry: hardware each worker reported, its measured throughput, and the
roster `fedq workers` prints (:func:`roster`: inspect merged with the registry)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

import fedq.identity as identity
from fedq.coordinator.enrol import registry_if_required
from fedq.db import ClientUpdate, Worker, session_scope
from fedq.db.models import Availability, aware, utcnow
from fedq.db.session import ensure_schema
from fedq.engine.broker import live_queues, registered_slots
from fedq.engine.names import (
    LOST_REASON,
    REGISTER_WORKER_TASK,
    STOPPED_REASON,
    WORKER_STATE_TASK,
    site_queue,
)
from fedq.protocol.envelope import FEDQ_VERSION, MESSAGE_FORMAT, QUEUE
from fedq.redaction import redact_text
from fedq.settings import Settings
from fedq.status import FAILED_UPDATES, UpdateStatus

log = logging.getLogger(__name__)

#: Weight of the newest measurement in the throughput moving average.
THROUGHPUT_ALPHA = 0.3


def message_signer(settings: Settings, task: str, args: Sequence[Any],
                   signed: Any) -> str | None:
    """Who signed a worker's control message (FEDQ_IDENTITY=required), or None when
    identity is off; raises :class:`fedq.identity.Refused` for a message that is not
    signed for these arguments, lately, by an active registered worker."""
    reg = registry_if_required(settings)
    if reg is None:
        return None
    return identity.check_message(signed, task, args, reg.active, reg.revoked)


def refused(task: str, hostname: Any, exc: Exception) -> str:
    """The answer to a control message refused for its signature (logged once)."""
    shown = hostname[:200] if isinstance(hostname, str) else "?"
    log.warning("refused %s for %s: %s", task, shown, exc)
    return f"refused {shown}: {exc}"


def _claim(row: Worker, signer: str | None) -> str | None:
    """Why ``signer`` may not speak for ``row``'s hostname (another registered worker's
    since its first signed message), or None; binds an unclaimed row to ``signer``."""
    if signer is None:
        return None
    if row.signer is not None and row.signer != signer:
        return f"hostname {row.hostname} belongs to registered worker {row.signer}"
    row.signer = signer
    return None


def record_worker(db_url: str, hostname: Any, queues: Any, hardware: Any,
                  version: Any = None, message_format: Any = None, *,
                  signer: str | None = None) -> str:
    """Insert or refresh a worker's row (called by the control task at worker start);
    returns what was recorded, or why nothing was. Every argument comes from the
    worker: bounded and typed here before it reaches a row. ``signer``: the registered
    worker that signed the message (FEDQ_IDENTITY=required), which the hostname then
    belongs to."""
    if not isinstance(hostname, str) or not 0 < len(hostname) <= 200:
        return "refused: hostname is not a string of 1..200 characters"
    if not isinstance(queues, list) or not all(isinstance(q, str) and QUEUE.fullmatch(q)
                                               for q in queues) or len(queues) > 32:
        return f"refused {hostname}: queues are not a list of queue names"
    if not isinstance(hardware, dict) or len(json.dumps(hardware)) > 64 << 10:
        return f"refused {hostname}: the hardware report is not an object of at most 64 KiB"
    version = version[:32] if isinstance(version, str) else None
    fmt = message_format if isinstance(message_format, int) and \
        not isinstance(message_format, bool) and 0 <= message_format < 2**31 else None
    ensure_schema(db_url)
    with session_scope(db_url) as s:
        row = s.get(Worker, hostname)
        if row is None:
            row = Worker(hostname=hostname, queues=queues, hardware=hardware, tasks_done=0,
                         fedq_version=version, message_format=fmt)
            s.add(row)
        else:
            row.queues, row.hardware, row.last_seen = queues, hardware, utcnow()
            row.fedq_version, row.message_format = version, fmt
            if row.available is False and row.away_reason in (STOPPED_REASON, LOST_REASON):
                # started again after it stopped or was lost: back (its run policy, if
                # any, reports its owner's conditions next)
                _reopen(s, row)
        taken = _claim(row, signer)
        if taken:
            s.rollback()
            return refused(REGISTER_WORKER_TASK, hostname, ValueError(taken))
    problem = incompatibility(version, fmt)
    if problem:
        log.warning("worker %s: %s", hostname, problem)
    return hostname


def record_availability(db_url: str, hostname: Any, available: Any, reason: Any, *,
                        signer: str | None = None) -> str:
    """A worker's report that it stepped aside for its owner (``available`` False, with
    the reason) or came back: its row and one history row. ``available`` None: the
    worker says it is here (fedq/worker/signals.py ``say_present``): seen now, and back
    if it was recorded lost; its owner's conditions are left as they are. From the
    worker: typed and bounded here. ``signer``: as for :func:`record_worker`."""
    if not isinstance(hostname, str) or not 0 < len(hostname) <= 200:
        return "refused: hostname is not a string of 1..200 characters"
    if available is None:
        return _present(db_url, hostname, signer)
    if not isinstance(available, bool):
        return f"refused {hostname}: available is not true, false or null"
    if reason is not None and not isinstance(reason, str):
        return f"refused {hostname}: the reason is not a string"
    reason = redact_text(reason)[:200] if reason and not available else None
    ensure_schema(db_url)
    now = utcnow()
    with session_scope(db_url) as s:
        row = s.get(Worker, hostname)
        if row is None:
            row = Worker(hostname=hostname, queues=[], hardware={}, tasks_done=0)
            s.add(row)
        taken = _claim(row, signer)
        if taken:
            s.rollback()
            return refused(WORKER_STATE_TASK, hostname, ValueError(taken))
        row.available, row.away_reason, row.available_since = available, reason, now
        s.add(Availability(hostname=hostname, available=available, reason=reason, at=now))
    log.info("worker %s: %s", hostname, "available" if available else f"away ({reason})")
    return hostname


def _present(db_url: str, hostname: str, signer: str | None) -> str:
    """A registered worker is here: last seen now, and reopened if it was lost. A
    hostname with no row is not recorded (a worker registers before it beats)."""
    ensure_schema(db_url)
    with session_scope(db_url) as s:
        row = s.get(Worker, hostname)
        if row is None:
            return f"refused {hostname}: not a registered worker"
        taken = _claim(row, signer)
        if taken:
            s.rollback()
            return refused(WORKER_STATE_TASK, hostname, ValueError(taken))
        row.last_seen = utcnow()
        if row.available is False and row.away_reason == LOST_REASON:
            _reopen(s, row)
            log.info("worker %s: here again", hostname)
    return hostname


def mark_lost(session: Any, lost: Iterable[tuple[str, str]]) -> list[str]:
    """Close the sites of workers whose task's heartbeat stopped: each (host, queue) is
    a lost claim's host and the site queue the coordinator sent that task to. The host
    is recorded away ("heartbeat lost") only if it registered on that queue: the claim's
    host is the worker's word, so a worker can close no site but the one whose task it
    took. Back when it registers again, a heartbeat of its moves (:func:`back`) or it
    says it is here (:func:`_present`).
    Runs inside the caller's transaction; the hosts it closed."""
    now, closed = utcnow(), []
    for host, queue in sorted(set(lost)):
        row = session.get(Worker, host)
        if row is None or row.available is False or queue not in (row.queues or ()):
            continue
        row.available, row.away_reason, row.available_since = False, LOST_REASON, now
        session.add(Availability(hostname=host, available=False, reason=LOST_REASON, at=now))
        closed.append(host)
    if closed:
        log.warning("site worker(s) %s: heartbeat lost; their sites are closed until they "
                    "come back", ", ".join(closed))
    return closed


def _reopen(session: Any, row: Worker) -> None:
    """A worker recorded stopped or lost is back: no condition known, one history row."""
    row.available, row.away_reason, row.available_since = None, None, utcnow()
    session.add(Availability(hostname=row.hostname, available=True, reason=None,
                             at=row.available_since))


def back(session: Any, hosts: Iterable[str]) -> None:
    """These hosts' heartbeats moved: those recorded lost (:func:`mark_lost`) are back."""
    for host in sorted(set(hosts)):
        row = session.get(Worker, host)
        if row is not None and row.available is False and row.away_reason == LOST_REASON:
            _reopen(session, row)
            log.info("worker %s: heartbeat back", host)


def availability(db_url: str) -> dict[str, list[tuple[Any, bool, str | None]]]:
    """Each worker's availability changes, oldest first: (time, available, reason)."""
    ensure_schema(db_url)
    with session_scope(db_url) as s:
        query = select(Availability).order_by(Availability.at, Availability.id)
        out: dict[str, list[tuple[Any, bool, str | None]]] = {}
        for a in s.scalars(query):
            out.setdefault(a.hostname, []).append((aware(a.at), a.available, a.reason))
        return out


def incompatibility(version: str | None, message_format: int | None) -> str | None:
    """Why a worker that registered with (``version``, ``message_format``) cannot work
    with this coordinator, in one line; None when it can."""
    if message_format == MESSAGE_FORMAT:
        return None
    said = f"message format {message_format} (fedq {version})" if message_format is not None \
        else "no message format (a fedq from before the version handshake)"
    return (f"incompatible: it speaks {said}, the coordinator {MESSAGE_FORMAT} (fedq "
            f"{FEDQ_VERSION}); its tasks are refused: install fedq {FEDQ_VERSION} there")


def ema(previous: float | None, sample: float, alpha: float = THROUGHPUT_ALPHA) -> float:
    return sample if previous is None else (1 - alpha) * previous + alpha * sample


def worker_rows(session: Any, names: Iterable[str]) -> dict[str, Worker]:
    """The Worker rows of ``names`` in one SELECT; a name without a row gets a new one.
    The dict holds them: the session's identity map holds a flushed row only weakly,
    so a row fetched by ``session.get`` in one function was read again in the next."""
    wanted = sorted(set(names))
    rows = {w.hostname: w for w in session.scalars(
        select(Worker).where(Worker.hostname.in_(wanted)))} if wanted else {}
    for name in wanted:
        if name not in rows:
            rows[name] = Worker(hostname=name, queues=[], hardware={}, tasks_done=0,
                                tasks_failed=0)
            session.add(rows[name])
    return rows


def record_throughput(session: Any, measurements: Iterable[tuple[str, int, float]],
                      rows: dict[str, Worker] | None = None) -> None:
    """Fold (worker, samples processed, seconds) into each worker's moving average, in
    order. ``rows``: the workers' rows when the caller has them (:func:`worker_rows`).

    Runs inside the caller's transaction (the round commit). Grouped by worker first,
    and the rows read in one SELECT, so each worker's row is read once however many
    clients it trained (docs/benchmarks.md, "Scale")."""
    now = utcnow()
    rates: dict[str, list[float]] = {}
    for hostname, seen, seconds in measurements:
        if seconds > 0 and seen > 0:
            rates.setdefault(hostname, []).append(seen / seconds)
    if rows is None or not set(rates) <= set(rows):
        rows = worker_rows(session, rates)
    for hostname, theirs in rates.items():
        row = rows[hostname]
        for rate in theirs:
            row.samples_per_second = ema(row.samples_per_second, rate)
        row.tasks_done = (row.tasks_done or 0) + len(theirs)
        row.last_seen = now


def record_tasks(session: Any, rows: Iterable[ClientUpdate],
                 workers: dict[str, Worker] | None = None) -> None:
    """Per-worker diagnostics from finished task rows: failures (``error``,
    ``rejected``), the GPU memory and utilisation of the last task, when it ran.
    ``workers``: the workers' rows when the caller has them (:func:`worker_rows`).

    Runs inside the caller's transaction (the round commit, a buffered absorb); grouped
    by worker as :func:`record_throughput` is."""
    now = utcnow()
    theirs: dict[str, list[ClientUpdate]] = {}
    for row in rows:
        if (name := task_worker(row)) is not None:
            theirs.setdefault(name, []).append(row)
    if workers is None or not set(theirs) <= set(workers):
        workers = worker_rows(session, theirs)
    for name, done in theirs.items():
        worker = workers[name]
        for row in done:
            if row.status in FAILED_UPDATES:
                worker.tasks_failed = (worker.tasks_failed or 0) + 1
            if row.gpu_peak_mb is not None or row.gpu_util is not None:
                worker.gpu_peak_mb, worker.gpu_util = row.gpu_peak_mb, row.gpu_util
            if row.codec:
                worker.codec = row.codec
            if row.uplink_mbit:
                worker.uplink_mbit = row.uplink_mbit
        worker.last_task_at = now


def task_worker(row: ClientUpdate) -> str | None:
    """The worker a finished task row counts for (:func:`record_tasks`), or None."""
    if row.worker and row.worker != "?" and \
            row.status not in (UpdateStatus.TRAINING, UpdateStatus.MISSING):
        return row.worker
    return None


def list_workers(db_url: str) -> list[dict[str, Any]]:
    ensure_schema(db_url)
    with session_scope(db_url) as s:
        return [{"hostname": w.hostname, "queues": w.queues, "hardware": w.hardware,
                 "tasks_done": w.tasks_done, "tasks_failed": w.tasks_failed or 0,
                 "samples_per_second": w.samples_per_second,
                 "gpu_peak_mb": w.gpu_peak_mb, "gpu_util": w.gpu_util,
                 "uplink_mbit": w.uplink_mbit, "codec": w.codec,
                 "fedq_version": w.fedq_version, "message_format": w.message_format,
                 "problem": incompatibility(w.fedq_version, w.message_format)
                 if w.hardware else None,
                 "last_task": aware(w.last_task_at).isoformat(timespec="seconds")
                 if w.last_task_at else None,
                 "last_seen": aware(w.last_seen).isoformat(timespec="seconds"),
                 "available": w.available, "away_reason": w.away_reason,
                 "available_since": aware(w.available_since).isoformat(timespec="seconds")
                 if w.available_since else None}
                for w in s.scalars(select(Worker).order_by(Worker.hostname))]


def queue_throughput(db_url: str, live: dict[str, list[str]]) -> dict[str, float]:
    """Summed throughput of the live workers of each queue; unmeasured workers count as
    the median of the measured ones (or 1.0 when none is measured). A worker that has
    stepped aside for its machine's owner (docs/owners.md) counts nothing: it stops
    consuming, but Celery's inspect may still list its queue for a moment."""
    return LiveView.of(list_workers(db_url), live).throughput


@dataclass(frozen=True)
class LiveView:
    """The training workers as the round planner sees them now: who consumes each queue
    (Celery's inspect), their summed throughput, and who has stepped aside."""

    consumers: dict[str, list[str]]  # queue -> hostnames of its live consumers
    throughput: dict[str, float]  # queue -> summed samples/s (away workers: 0)
    away: frozenset[str]
    slots: dict[str, int] = field(default_factory=dict)  # hostname -> tasks at once

    @classmethod
    def of(cls, workers: list[dict[str, Any]], live: dict[str, list[str]]) -> LiveView:
        """A worker's throughput is its tasks' measured samples/s (each task's, with its
        neighbours running beside it) times its slots: a worker started with ``-c N``
        trains N clients at once (:func:`fedq.engine.broker.registered_slots`)."""
        rows = {w["hostname"]: w["samples_per_second"] for w in workers}
        slots = {w["hostname"]: registered_slots(w["hardware"]) for w in workers}
        away = frozenset(w["hostname"] for w in workers if w["available"] is False)
        measured = sorted(v for v in rows.values() if v)
        default = measured[len(measured) // 2] if measured else 1.0
        return cls(live, {q: sum(0.0 if h in away else (rows.get(h) or default)
                                 * slots.get(h, 1) for h in hosts)
                          for q, hosts in live.items()}, away, slots)

    def available(self, queues: Iterable[str]) -> int:
        """Worker slots consuming any of ``queues`` now that have not stepped aside: a
        worker started with ``-c N`` counts N times, once however many queues it takes."""
        return sum(self.slots.get(h, 1) for h in {h for q in queues
                                                  for h in self.consumers.get(q, ())
                                                  if h not in self.away})


def open_sites(session: Any, sites: Iterable[str]) -> frozenset[str]:
    """Of ``sites``, those with a registered worker consuming the site's queue that has
    not stepped aside for its owner nor been stopped (read from SQL, not inspect: cheap
    enough for every buffered refill; a worker killed without its shutdown still counts,
    and the deadline settles its tasks)."""
    wanted = {site_queue(n): n for n in sites}
    rows = session.execute(select(Worker.queues, Worker.available)).tuples()
    return frozenset(wanted[q] for queues, available in rows if available is not False
                     for q in (queues or ()) if q in wanted)


def gone_sites(session: Any, sites: Iterable[str]) -> frozenset[str]:
    """Of ``sites``, those whose registered workers are all lost or stopped (none may
    come back soon; a site away for its owner is not gone: its queued tasks are the
    first it trains when it is back)."""
    wanted = {site_queue(n): n for n in sites}
    state: dict[str, bool] = {}
    rows = session.execute(select(Worker.queues, Worker.available, Worker.away_reason)).tuples()
    for queues, available, reason in rows:
        dead = available is False and reason in (LOST_REASON, STOPPED_REASON)
        for q in queues or ():
            if q in wanted:
                state[q] = state.get(q, True) and dead
    return frozenset(wanted[q] for q, dead in state.items() if dead)


def live_view(settings: Settings) -> LiveView | None:
    """The planner's view of the live workers; None when no worker answers inspect in
    time (the planner then plans as if nothing were known)."""
    try:
        live = live_queues(timeout=1.0)
    except Exception:  # noqa: BLE001 - no answer from the broker: plan blind
        return None
    return LiveView.of(list_workers(settings.database_url), live)


def live_throughput(settings: Settings) -> dict[str, float]:
    """Queue -> summed measured throughput of its live consumers (for ``queues: auto``)."""
    view = live_view(settings)
    return view.throughput if view is not None else {}


@dataclass(frozen=True)
class WorkerRow:
    """One worker as `fedq workers` shows it: what Celery's inspect says now, merged
    with what it registered and what its tasks measured."""

    host: str
    live: bool  # answered inspect now
    problem: str | None  # why it cannot work with this coordinator (version handshake)
    queues: list[str]
    running: int | None  # tasks running now (None: not live)
    hardware: str  # its GPUs with their capability, or its CPU count
    torch: str
    samples_per_second: float | None
    tasks_done: int
    tasks_failed: int
    gpu_peak_mb: float | None
    gpu_util: float | None
    uplink: str  # measured uplink and the codec it chose
    last_task: str | None  # ISO time
    last_seen: str | None
    available: bool | None = None  # its owner's conditions let it train (None: no policy)
    away_reason: str | None = None  # why not ("owner active", "on battery", ...)
    available_since: str | None = None  # ISO time of its last change


def hardware_text(hw: dict[str, Any]) -> str:
    """A worker's registered hardware as `fedq workers` shows it: its GPUs with their
    capability, or its CPU count, and its slots when it runs more than one task at once
    (``-c N``)."""
    text = ", ".join(f"{g['name']} (sm_{g['capability'][0]}{g['capability'][1]})"
                     for g in hw.get("gpus") or []) \
        or (f"cpu x{hw.get('cpus', '?')}" if hw else "-")
    slots = registered_slots(hw)
    return f"{text}, {slots} slots" if slots > 1 else text


def roster(settings: Settings, timeout: float = 1.0) -> list[WorkerRow]:
    """Every worker live now or registered, by host name (asks the broker: raises
    ServiceUnavailable when it cannot be reached)."""
    from fedq.engine.app import app
    from fedq.engine.broker import check_broker

    check_broker()
    insp = app.control.inspect(timeout=timeout)
    queues = insp.active_queues() or {}
    active = insp.active() or {}
    known = {w["hostname"]: w for w in list_workers(settings.database_url)}
    rows = []
    for host in sorted(set(queues) | set(known)):
        info = known.get(host, {})
        hw = info.get("hardware") or {}
        hardware = hardware_text(hw)
        live = host in queues
        # a worker that stepped aside for its owner consumes nothing: its registered queues
        consuming = [q["name"] for q in queues[host]] if live else []
        rows.append(WorkerRow(
            host=host, live=live, problem=info.get("problem"),
            queues=consuming or list(info.get("queues") or []),
            running=len(active.get(host, [])) if live else None, hardware=hardware,
            torch=str(hw.get("torch", "-")), samples_per_second=info.get("samples_per_second"),
            tasks_done=info.get("tasks_done", 0), tasks_failed=info.get("tasks_failed", 0),
            gpu_peak_mb=info.get("gpu_peak_mb"), gpu_util=info.get("gpu_util"),
            uplink=" ".join(x for x in (
                f"{info['uplink_mbit']:.0f} Mbit/s" if info.get("uplink_mbit") else "",
                info.get("codec") or "") if x) or "-",
            last_task=info.get("last_task"), last_seen=info.get("last_seen"),
            available=info.get("available"), away_reason=info.get("away_reason"),
            available_since=info.get("available_since")))
    return rows


def incompatible_workers(settings: Settings) -> list[str]:
    """One line per registered worker of another message format (the version
    handshake), for `fedq doctor --services` on the coordinator's host; nothing where
    the database cannot be reached (a worker machine has none)."""
    try:
        rows = list_workers(settings.database_url)
    except Exception:  # noqa: BLE001 - a worker machine has no database: nothing to say
        return []
    return [f"worker {w['hostname']}: {w['problem']}" for w in rows if w.get("problem")]
