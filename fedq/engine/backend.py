"""Celery's Redis result backend, without result subscriptions that nobody reads.

Celery's Redis backend subscribes the process to a task's result channel whenever a
``GroupResult`` is built, whether or not anybody will wait on it: a chord builds two
(``RedisBackend.apply_chord`` and the header group), so every chord a fedq worker sent
subscribed it to each training task's channel. fedq reads results by task id and
never waits inside a worker, so the subscriptions (and the result objects Celery kept
for them) only piled up: 400 channels after 100 rounds of 4 clients on the control
worker, whose memory grew with them (docs/benchmarks.md, "Scale"). Unsubscribing
afterwards does not help: redis-py keeps each channel until the confirmation is read,
and nothing reads that connection.

Inside a worker (where Celery says joining a result would block) this backend does
not register results as pending; everywhere else it is Celery's. ``fedq.engine.app`` selects
it for ``redis://`` and ``rediss://`` result backends.

Storing a task's state is one round trip to Redis, not two. Celery reads the task's
key before each write (``GET``), so that a lost worker's late state never overwrites a
stored ``SUCCESS``, then writes it (``SET`` and ``PUBLISH``); a training task stores
its claim, its heartbeats and its answer that way, each a wait on a Redis the whole
round shares. The same rule runs here inside Redis, in one Lua script (``_STORE``):
atomic, where Celery's read and write had a gap between them. Measured in
docs/benchmarks.md ("A round of 1,000 clients").
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from celery import states
from celery._state import task_join_will_block
from celery.backends.filesystem import FilesystemBackend
from celery.backends.redis import RedisBackend as CeleryRedisBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str

from fedq.errors import FedqError

#: KEYS[1] the task's key; ARGV[1] the encoded state, ARGV[2] its lifetime in seconds
#: (0: none), ARGV[3] "1" to leave a stored REVOKED in place and answer it. Celery's
#: rule: a stored SUCCESS is never overwritten (Celery 5.7,
#: ``BaseKeyValueStoreBackend._store_result``); then what Celery's ``_set`` sends.
_STORE = """
local current = redis.call('GET', KEYS[1])
if current then
  local ok, meta = pcall(cjson.decode, current)
  if ok and type(meta) == 'table' then
    if meta['status'] == 'SUCCESS' then
      return 0
    end
    if meta['status'] == 'REVOKED' and
        (ARGV[3] == '1' or (ARGV[3] == '2' and meta['stop'] == true)) then
      return current
    end
  end
end
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
"""

#: KEYS the tasks' keys; ARGV[1] the most bytes a stored state may have. Each key's
#: value, false where there is none, or its length (an integer) where it is longer than
#: that: such a value is never read, here or by the caller.
_READ_BOUNDED = """
local out = {}
local bound = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  local n = redis.call('STRLEN', key)
  if n > bound then
    out[i] = n
  elseif n > 0 then
    out[i] = redis.call('GET', key)
  else
    out[i] = false
  end
end
return out
"""


class RedisBackend(CeleryRedisBackend):  # type: ignore[misc]
    _store_script: Any = None
    _read_script: Any = None

    def _store_result(self, task_id: str, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        """Celery's ``_store_result`` in one round trip (the module's docstring). A
        serializer other than JSON (the script reads the stored state as JSON) takes
        Celery's own path."""
        if self.serializer != "json":
            return super()._store_result(task_id, result, state, traceback, request, **kwargs)
        value = self._state_value(task_id, result, state, traceback, request)
        expires = self.failure_expires if state == states.FAILURE else self.expires
        self.ensure(self._store, (self.get_key_for_task(task_id), value, expires or 0))
        return result

    def store_unless_revoked(self, task_id: str, result: Any, state: str,
                             stopping_only: bool = False) -> Any:
        """Store ``result`` as the task's ``state`` (as ``store_result`` does) unless the
        task is marked ``REVOKED`` (fedq/engine/revoke.py), or with ``stopping_only``
        unless it is marked ``REVOKED`` with ``stop`` (a running task must stop: a
        heartbeat's write); then nothing is written and the stored state comes back,
        deserialised (never turned into a result: no exception is rebuilt from what a
        worker wrote). None when it was stored, or kept a stored SUCCESS. One round
        trip: a training task's revocation check and claim, or a heartbeat."""
        if self.serializer != "json":
            raise NotImplementedError("store_unless_revoked reads states as JSON")
        value = self._state_value(task_id, self.encode_result(result, state), state)
        stored = self.ensure(self._store, (self.get_key_for_task(task_id), value,
                                           self.expires or 0, 2 if stopping_only else 1))
        if not isinstance(stored, bytes):
            return None
        try:
            return self.decode(stored)
        except Exception:  # noqa: BLE001 - the script read it as a REVOKED object
            return {"status": states.REVOKED, "result": None}

    def _state_value(self, task_id: str, result: Any, state: str, traceback: Any = None,
                     request: Any = None) -> str | bytes:
        """The stored form of a task's state, as Celery's ``_store_result`` and ``set``
        build and bound it."""
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request)
        meta["task_id"] = bytes_to_str(task_id)
        value: str | bytes = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state,
                                    task_id=task_id)
        return value

    def _store(self, key: str | bytes, value: str | bytes, expires: float,
               keep_revoked: int = 0) -> Any:
        """``keep_revoked``: 0 overwrite any state but SUCCESS, 1 also keep a REVOKED
        one, 2 keep only a REVOKED one marked ``stop``."""
        if self._store_script is None:
            self._store_script = self.client.register_script(_STORE)
        return self._store_script(keys=[key], args=[value, int(expires), int(keep_revoked)])

    def read_bounded(self, keys: Sequence[str | bytes], bound: int) -> list[bytes | int | None]:
        """Each key's stored state in one round trip (a script: ``MGET`` with a bound);
        its length instead where it is over ``bound`` bytes, None where there is none."""
        if self._read_script is None:
            self._read_script = self.client.register_script(_READ_BOUNDED)
        values: list[bytes | int | None] = self.ensure(
            lambda: self._read_script(keys=list(keys), args=[bound]), ())
        return values

    def _add_pending_result(self, task_id: str, result: Any, weak: bool = False) -> None:
        if task_join_will_block():  # a worker: nobody will wait on this result here
            return
        super()._add_pending_result(task_id, result, weak=weak)


#: Task keys read in one round trip: a round of 10,000 clients is ten.
METAS_PER_READ = 1000
#: The most bytes a task's stored state may have to be read by :func:`task_metas`. A
#: training result is a small JSON object (fedq/protocol/training.py ``UpdateRef``: a few kB at
#: most); a worker can write anything under its task's key, and a batch of reads must
#: not hold a batch of huge values.
STATE_BYTES = 256 << 10
#: The status :func:`task_metas` gives a state over :data:`STATE_BYTES` (not read;
#: ``bytes``: its length).
TOO_LARGE = "FEDQ_TOO_LARGE"
#: The status :func:`task_metas` gives a state that does not decode (``error``: why).
#: Whoever can write a task's key can write anything there: not JSON, JSON nested past
#: the recursion limit, an object without Celery's keys, an exception state naming a
#: class Celery refuses to rebuild. Each is no answer for that one task.
UNDECODABLE = "FEDQ_UNDECODABLE"
#: The statuses of a state :func:`task_metas` did not decode: the task has an answer
#: that counts for nothing (:func:`unread_reason` says why).
UNREAD = (TOO_LARGE, UNDECODABLE)


def task_metas(backend: Any, task_ids: Sequence[str],
               bound: int | None = None) -> list[dict[str, Any]]:
    """Each task's stored state, as Celery's ``get_task_meta`` reads it (a task with no
    state is PENDING), in the order of ``task_ids``. A state longer than ``bound`` bytes
    (:data:`STATE_BYTES` by default) is not read: its meta is
    ``{"status": TOO_LARGE, "bytes": n}``.
    On fedq's Redis backend :data:`METAS_PER_READ` keys are read a round trip (where
    ``get_task_meta`` makes one per task: 1,000 of them in a round of 1,000 clients);
    the embedded default's files are read one by one, each up to the bound; another
    backend (fedq configures none) by ``get_task_meta``."""
    bound = STATE_BYTES if bound is None else bound
    if isinstance(backend, FilesystemBackend):
        return [_meta(backend, _read_file(backend, t, bound)) for t in task_ids]
    if not isinstance(backend, RedisBackend):
        return [backend.get_task_meta(t) for t in task_ids]
    metas: list[dict[str, Any]] = []
    for lo in range(0, len(task_ids), METAS_PER_READ):
        keys = [backend.get_key_for_task(t) for t in task_ids[lo:lo + METAS_PER_READ]]
        metas += [_meta(backend, v) for v in backend.read_bounded(keys, bound)]
    return metas


def _meta(backend: Any, value: bytes | int | None) -> dict[str, Any]:
    """A state as read by :func:`task_metas`: its bytes, none, or its length (over the
    bound, unread)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {"status": TOO_LARGE, "result": None, "bytes": value}
    if not isinstance(value, (bytes, str)) or not value:
        return {"status": states.PENDING, "result": None}
    return decode_state(backend, value)


def decode_state(backend: Any, value: bytes | str) -> dict[str, Any]:
    """A stored (or published) state as Celery's ``decode_result`` reads it, or
    ``{"status": UNDECODABLE, "error": why}``: never raises, whatever ``value`` holds
    (Celery raises DecodeError, TypeError, KeyError, RecursionError, kombu's errors and
    SecurityError for different malformed states)."""
    try:
        meta = backend.decode_result(value)
    except Exception as exc:  # noqa: BLE001 - anything a writer put there
        return {"status": UNDECODABLE, "result": None,
                "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    if not isinstance(meta, dict) or not isinstance(meta.get("status"), str):
        return {"status": UNDECODABLE, "result": None,
                "error": "not an object with a status"}
    return meta


def unread_reason(meta: dict[str, Any], bound: int = STATE_BYTES) -> str | None:
    """Why a state :func:`task_metas` returned counts as no answer (over its bound, or
    undecodable), or None for a state that was read."""
    if meta.get("status") == TOO_LARGE:
        return (f"{meta.get('bytes')} bytes in the result backend, more than the {bound} a "
                f"result may have; not read")
    if meta.get("status") == UNDECODABLE:
        return f"the stored state does not decode ({meta.get('error')})"
    return None


def _read_file(backend: FilesystemBackend, task_id: str, bound: int) -> bytes | int | None:
    """One task's state from Celery's file backend, up to ``bound`` bytes (its length
    where it is longer); None where there is none."""
    path = backend._filename(backend.get_key_for_task(task_id))  # Celery's own path
    try:
        with open(path, "rb") as f:
            value = f.read(bound + 1)
            return os.fstat(f.fileno()).st_size if len(value) > bound else value
    except FileNotFoundError:
        return None


def send_and_poll(app: Any, name: str, args: tuple[Any, ...], queue: str, timeout: float,
                  **options: Any) -> Any:
    """Send task ``name`` and wait up to ``timeout`` seconds for its result by reading
    its state (no subscription to its channel: a registered worker's broker user may
    not subscribe to any task's channel). Raises Celery's TimeoutError when none came,
    and a one-line FedqError when the task failed."""
    import time

    from celery import _state
    from celery.exceptions import TimeoutError as CeleryTimeout

    before = _state.task_join_will_block()
    _state._set_task_join_will_block(True)  # the backend subscribes to nothing
    try:
        result = app.send_task(name, args=args, queue=queue, **options)
    finally:
        _state._set_task_join_will_block(before)
    deadline = time.monotonic() + timeout
    wait = 0.02
    while time.monotonic() < deadline:
        meta = task_metas(app.backend, [result.id])[0]
        if meta.get("status") == states.SUCCESS:
            return meta.get("result")
        if meta.get("status") in states.PROPAGATE_STATES or meta.get("status") in UNREAD:
            raise FedqError(f"task {name} ended {meta.get('status')}: "
                            f"{str(meta.get('result') or meta.get('error'))[:200]}")
        time.sleep(wait)
        wait = min(wait * 1.5, 0.25)
    raise CeleryTimeout(f"no answer to {name} within {timeout:g} s")
