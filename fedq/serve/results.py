"""A batch's answer and stream pieces as the result backend holds them: read within
a bound, decoded in a guard, checked item by item (and, with identity required, its
signature) before any of it reaches a client; the notices that say a state was
stored."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import fedq.identity as identity
from fedq.engine.app import app
from fedq.engine.backend import TOO_LARGE, UNDECODABLE, decode_state, task_metas
from fedq.inference.run import encode_rows
from fedq.protocol.envelope import FormatError
from fedq.protocol.inference import check_output
from fedq.serve.openai import error_object, stopped, usage
from fedq.serve.served import DECODE_INLINE_BYTES, Refused, Served

log = logging.getLogger(__name__)


@dataclass
class _Item:
    body: Any
    future: asyncio.Future[tuple[Any, int]]
    texts: asyncio.Queue[str] | None = None  # streamed: each newer text so far
    last: str = ""


@dataclass
class Notice:
    """A waiter's doorbell, and the states published for its task, oldest first."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    states: list[Any] = field(default_factory=list)

    async def next_state(self, timeout: float, bound: int) -> dict[str, Any] | None:
        """The next published state, decoded as the backend decodes what it reads from
        the key; None when none came within ``timeout`` seconds. One longer than
        ``bound`` bytes is refused undecoded."""
        if not self.states:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.event.wait(), timeout)
            self.event.clear()
        if not self.states:
            return None
        data = self.states.pop(0)
        if not isinstance(data, (bytes, str)):
            return None
        if len(data) > bound:
            raise too_long(len(data), bound)
        if len(data) > DECODE_INLINE_BYTES:  # a large answer: off the event loop
            return await asyncio.to_thread(decoded, decode_state, app.backend, data)
        return decoded(decode_state, app.backend, data)


def too_long(size: int, bound: int) -> Refused:
    return Refused(502, f"the batch's answer is {size} bytes, more than the {bound} its "
                        "items may have; not read")


def read_state(task_id: str, bound: int) -> dict[str, Any]:
    """A batch task's state read from its key, up to ``bound`` bytes (a longer one is
    refused unread), decoded as :func:`decoded` does."""
    meta = decoded(lambda: task_metas(app.backend, [task_id], bound)[0])
    if meta.get("status") == TOO_LARGE:
        raise too_long(meta["bytes"], bound)
    return meta


def decoded(read: Any, *args: Any) -> dict[str, Any]:
    """A task's state as the result backend decodes it (``read(*args)``); a state that
    does not decode (fedq.engine.backend.decode_state) is a refused answer, never a
    crash."""
    meta = read(*args)
    if not isinstance(meta, dict):
        raise Refused(502, f"the batch's answer is a {type(meta).__name__}, not an object")
    if meta.get("status") == UNDECODABLE:
        raise Refused(502, f"the batch's answer does not decode: {meta.get('error')}")
    return meta


class ResultWatch:
    """Wakes a batch's waiter when the result backend stores its task's state.

    Celery's Redis result backend publishes every state it stores (a stream's pieces,
    the answer) on the channel named by the task's key; one pattern subscription for
    the gateway's task ids hears them all, so a waiter has the state as soon as it is
    written instead of at its next poll. The backend publishes the very value it
    stores (``SET`` and ``PUBLISH`` in one pipeline), so the waiter takes the state from
    the notice, without a ``GET``: the same bytes, from the same writer (a worker's
    Redis user may write ``celery-task-meta-*`` keys and publish on the channels of the
    same names, nothing more: fedq/coordinator/acl.py), checked exactly as a state read
    from its key. The waiter still reads the key, slowly, in case a notice is lost (a
    reconnect)."""

    PATTERN = "fedq-serve-*"

    def __init__(self, url: str) -> None:
        import redis.asyncio

        self.client = redis.asyncio.Redis.from_url(url)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.waiting: dict[bytes, Notice] = {}
        self.heard = 0  # notices that woke a waiter (/health)
        self.prefix = app.backend.task_keyprefix
        if isinstance(self.prefix, str):
            self.prefix = self.prefix.encode()

    async def start(self) -> None:
        await self.pubsub.psubscribe(self.prefix + self.PATTERN.encode())

    async def listen(self) -> None:
        """Set the event of each task whose state was stored; runs until cancelled."""
        while True:
            try:
                message = await self.pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the waiters poll meanwhile
                log.warning("fedq serve: result notices lost (%s); polling", exc)
                await asyncio.sleep(1.0)
                with contextlib.suppress(Exception):
                    await self.start()
                continue
            if message is not None:
                notice = self.waiting.get(message.get("channel", b""))
                if notice is not None:
                    notice.states.append(message.get("data"))
                    notice.event.set()
                    self.heard += 1

    def watch(self, task_id: str) -> Notice:
        notice = Notice()
        self.waiting[self.prefix + task_id.encode()] = notice
        return notice

    def forget(self, task_id: str) -> None:
        self.waiting.pop(self.prefix + task_id.encode(), None)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.pubsub.aclose()
            await self.client.aclose()


def result_watch(url: str) -> ResultWatch | None:
    """A watch on a Redis result backend ``url``; None for other backends (polled)."""
    if not url.startswith(("redis://", "rediss://")):
        return None
    try:
        return ResultWatch(url)
    except Exception as exc:  # noqa: BLE001 - polling works without it
        log.warning("fedq serve: no result notices (%s); polling", exc)
        return None


def stream_texts(data: Any, batch: list[_Item], registry: identity.Registry | None = None,
                 task_id: str = "", queue: str | None = None,
                 token_chars: int = 1) -> list[str]:
    """A worker's progress on a batch of completions (its ``STREAMING`` state): the text
    so far of its first items; anything else, or a text longer than its item's
    ``max_tokens`` can decode to (``token_chars`` characters a token), is ignored.
    With identity required (``registry``), so is a piece not signed for ``task_id`` by
    an active registered worker: the result backend's entry is writable by any worker,
    and a streamed piece reaches the user before the signed answer does."""
    if registry is not None and (not isinstance(data, dict) or identity.result_problem(
            data, data.get("signer") if isinstance(data.get("signer"), str) else None,
            data.get("sig") if isinstance(data.get("sig"), str) else None, "?", task_id,
            registry, None if queue is None else [queue]) is not None):
        return []
    texts = data.get("stream") if isinstance(data, dict) else None
    if not isinstance(texts, list) or len(texts) > len(batch) or not all(
            isinstance(t, str) and isinstance(item.body, dict)
            and len(t) <= _max_tokens(item.body) * token_chars
            for t, item in zip(texts, batch)):
        return []
    return texts


def _pass_on(batch: list[_Item], texts: list[str]) -> None:
    for item, text in zip(batch, texts):
        if item.texts is not None and text != item.last:
            item.last = text
            item.texts.put_nowait(text)


def text_choice(text: str, finish: str | None) -> dict[str, Any]:
    """A streamed completion's choice: its new ``text``."""
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}


def chat_choice(text: str, finish: str | None, first: bool = False) -> dict[str, Any]:
    """A streamed chat completion's choice: its ``delta`` (the role in the first)."""
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
        ({"content": text} if text or finish is None else {})
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


async def stream_events(item: _Item, head: dict[str, Any], include_usage: bool = False,
                        stops: Sequence[str] = (), choice: Any = text_choice,
                        count: Callable[[str], int] | None = None) -> AsyncIterator[str]:
    """Server-sent events for one streamed completion: each piece added to its text,
    then the rest of the checked answer with ``finish_reason``, then ``[DONE]``; each
    choice shaped by ``choice(text, finish)`` (:func:`text_choice`,
    :func:`chat_choice`). With ``stops``, the text ends before the first of them
    (``finish_reason: stop``, sent as soon as a piece holds it), and the last
    characters of each piece that could begin one are held back until the next shows
    they do not. With ``include_usage`` (OpenAI's ``stream_options``) every chunk
    carries ``usage: null`` and one more chunk, with no choices and the request's
    :func:`usage` (tokens counted by ``count``), comes before ``[DONE]`` when the
    answer checked out."""
    more = {"usage": None} if include_usage else {}
    hold = max((len(x) for x in stops), default=1) - 1
    first = [choice is chat_choice]

    def event(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def piece(text: str, finish: str | None) -> str:
        shaped = choice(text, finish, True) if first[0] else choice(text, finish)
        first[0] = False
        return event({**head, "choices": [shaped], **more})

    def ending(text: str) -> Iterator[str]:
        if include_usage:
            yield event({**head, "choices": [],
                         "usage": usage([item.body["prompt"]], [text], count)})
        yield "data: [DONE]\n\n"

    assert item.texts is not None
    sent = ""
    while True:
        newer: asyncio.Future[Any] = asyncio.ensure_future(item.texts.get())
        waiting: set[asyncio.Future[Any]] = {item.future, newer}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if newer.done():
            text = newer.result()
            if not text.startswith(sent):
                continue
            shown, finish = stopped(text, stops)
            if finish == "stop":  # the text is whole: no need to wait for the rest
                yield piece(shown[len(sent):], "stop")
                for line in ending(shown):
                    yield line
                return
            safe = text[:max(len(sent), len(text) - hold)]
            if len(safe) > len(sent):
                yield piece(safe[len(sent):], None)
                sent = safe
            continue
        newer.cancel()
        try:
            out, _ = item.future.result()
        except Refused as exc:
            yield event(error_object(exc.status, str(exc)))
        else:
            final = out["text"]
            if final.startswith(sent):
                shown, finish = stopped(final, stops)
                yield piece(shown[len(sent):], finish)
                for line in ending(shown):
                    yield line
                return
            yield event(error_object(502, "the worker's answer does not continue what "
                                          "was streamed"))
        yield "data: [DONE]\n\n"
        return


def _max_tokens(body: Any) -> int:
    """The ``max_tokens`` a batch item asked for (0 for an item that is no completion)."""
    value = body.get("max_tokens", 0) if isinstance(body, dict) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def check_batch(data: Any, served: Served, n: int, task_id: str = "",
                op: str | None = None, queue: str | None = None,
                max_tokens: list[int] | None = None) -> list[dict[str, Any]]:
    """A worker's answer to a batch of ``n`` items (task ``task_id``; ``op``: what the
    batch asked, the served op by default), checked item by item, each generated text
    no longer than its item's ``max_tokens`` (default: the served bound); with identity
    required, signed for that task by an active registered worker registered for
    ``queue``, the queue the batch was sent to."""
    op = op or served.op
    if not isinstance(data, dict) or set(data) - {"status", "outputs", "worker", "seconds",
                                                  "error", "signer", "sig"}:
        raise Refused(502, "the answer is not {status, outputs, worker, seconds}")
    if served.registry is not None:
        signer, sig, worker = data.get("signer"), data.get("sig"), data.get("worker")
        problem = identity.result_problem(
            data, signer if isinstance(signer, str) else None,
            sig if isinstance(sig, str) else None,
            worker if isinstance(worker, str) else "?", task_id, served.registry,
            None if queue is None else [queue])
        if problem:
            raise Refused(502, f"signature: {problem}")
    if data.get("status") != "ok":
        raise Refused(502, f"the worker says: {str(data.get('error'))[:300]}")
    outputs = data.get("outputs")
    if not isinstance(outputs, list) or len(outputs) != n:
        raise Refused(502, f"{len(outputs) if isinstance(outputs, list) else 'no'} outputs "
                      f"for {n} items")
    try:
        check_output(encode_rows(outputs), op, 0, n,
                     served.width or 0 if op == "embed" else served.classes,
                     max_tokens if max_tokens is not None else served.max_tokens,
                     served.token_chars)
    except FormatError as exc:
        raise Refused(502, str(exc)) from None
    return [{k: v for k, v in out.items() if k != "i"} for out in outputs]
