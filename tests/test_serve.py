"""``fedq serve``: a real gateway process (uvicorn) in front of real workers on Redis:
requests batched (the batch sizes the workers saw), outputs equal to the model in one
process, 503 past the bound, a stopped worker's batch sent again, API keys."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fedq.data import load_dataset
from fedq.models import build_model, seeded_model
from fedq.serve.openai import parse_completion, parse_embeddings, parse_predict, stopped
from fedq.serve.results import check_batch
from fedq.serve.served import Refused, Served
from fedq.testing.cluster import Cluster, record
from fedq.testing.procs import start_workers
from fedq.testing.wait import wait_until
from fedq.weights import dumps, loads, state_of

from .conftest import free_port

SERVED = Served(name="m", op="classify", model={}, arch={}, classes=3, input_shape=(1, 2, 2),
                queues=["cpu"])


def test_a_streamed_answer_takes_only_checked_progress_and_a_final_that_continues_it() -> None:
    """What a worker writes while it generates is hostile too: anything but a list of
    strings no longer than their items' max_tokens is ignored; a piece that does not
    continue what was sent is not sent; a final answer that does not continue the
    stream ends it with an error event, never with other text."""
    import asyncio

    from fedq.serve.results import _Item, _pass_on, stream_events, stream_texts

    async def run(progress: list[Any], final: str) -> list[str]:
        loop = asyncio.get_running_loop()
        item = _Item({"prompt": "p", "max_tokens": 8}, loop.create_future(), asyncio.Queue())
        other = _Item({"prompt": "q", "max_tokens": 8}, loop.create_future())
        for data in progress:
            _pass_on([item, other], stream_texts(data, [item, other]))
        item.future.set_result(({"text": final}, 2))
        return [e async for e in stream_events(item, {"id": "c"})]

    events = asyncio.run(run([{"stream": ["to"]}, {"stream": ["to be"]},
                              {"stream": ["x" * 9]},  # longer than max_tokens: ignored
                              {"stream": "to be"}, {"stream": [1]}, ["to be"],  # not texts
                              {"stream": ["to", "be", "or"]},  # more texts than items
                              {"stream": ["tx"]}],  # does not continue "to be": not sent
                             "to be or"))
    texts = [json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["to", " be", " or"] and events[-1] == "data: [DONE]\n\n"
    events = asyncio.run(run([{"stream": ["to be"]}], "not that"))
    assert "does not continue what was streamed" in events[-2] and "not that" not in \
        "".join(events)
    # OpenAI's stream_options: usage null on every chunk, then a chunk of usage alone
    # (the prompt "p" and the final text in the byte-level model's tokens)

    async def with_usage(final: str) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        item = _Item({"prompt": "p", "max_tokens": 8}, loop.create_future(), asyncio.Queue())
        _pass_on([item], stream_texts({"stream": ["to"]}, [item]))
        item.future.set_result(({"text": final}, 1))
        return [json.loads(e[len("data: "):]) for e in
                [e async for e in stream_events(item, {"id": "c"}, include_usage=True)][:-1]]

    chunks = asyncio.run(with_usage("to be"))
    assert [c["usage"] for c in chunks] == [None, None, {
        "prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}], chunks
    assert [len(c["choices"]) for c in chunks] == [1, 1, 0]
    assert all("usage" not in json.loads(e[len("data: "):]) for e in events[:-1])
    chunks = asyncio.run(with_usage("not that"))  # refused: an error, no usage chunk
    assert "error" in chunks[-1] and all(c.get("usage") is None for c in chunks)

    # a stop: what could begin one is held back until a later piece shows it does not;
    # the stream ends at once when a piece holds it, before the worker's answer
    async def stopped_at(progress: list[str], stops: list[str], final: str | None,
                         **shape: Any) -> list[str]:
        loop = asyncio.get_running_loop()
        item = _Item({"prompt": "p", "max_tokens": 16}, loop.create_future(),
                     asyncio.Queue())
        for text in progress:
            _pass_on([item], stream_texts({"stream": [text]}, [item]))
        if final is not None:
            item.future.set_result(({"text": final}, 1))
        return [e async for e in stream_events(item, {"id": "c"}, stops=stops, **shape)]

    def pieces(events: list[str]) -> list[tuple[str, Any]]:
        return [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in
                (json.loads(e[len("data: "):]) for e in events[:-1])]

    events = asyncio.run(stopped_at(["to b", "to be<", "to be<e", "to be<end> more"],
                                    ["<end>"], None))
    assert pieces(events) == [("to", None), (" ", None), ("be", "stop")]
    assert events[-1] == "data: [DONE]\n\n"
    events = asyncio.run(stopped_at(["to be<"], ["<end>"], "to be<e and more"))
    assert pieces(events) == [("to", None), (" be<e and more", "length")]
    from fedq.serve.results import chat_choice

    events = asyncio.run(stopped_at(["hi"], [], "hi there", choice=chat_choice))
    deltas = [json.loads(e[len("data: "):])["choices"][0] for e in events[:-1]]
    assert [(d["delta"], d["finish_reason"]) for d in deltas] == [
        ({"role": "assistant", "content": "hi"}, None), ({"content": " there"}, "length")]


def test_a_published_state_is_read_from_its_notice_and_a_garbled_one_is_refused() -> None:
    """The gateway takes a batch's state from the result backend's notice (the value
    the backend stored, published beside it), in the order published; a notice whose
    data does not decode to an object is a refused answer (a 502 for its requests),
    never a crash of the batch's waiter. Drop the payload from Notice and the first
    assertion fails; drop decode_state's guard and the last ones raise other errors."""
    import asyncio

    from fedq.engine.app import app
    from fedq.serve.results import Notice, decoded

    stored = app.backend.encode({"status": "SUCCESS", "result": {"status": "ok"},
                                 "task_id": "t", "traceback": None, "children": []})

    async def run() -> list[Any]:
        notice = Notice()
        notice.states += [stored, b"x" * (70_000)]  # the second: large, decoded off the loop
        notice.event.set()
        got: list[Any] = [await notice.next_state(0.01, 100_000)]
        for _ in range(2):
            try:
                got.append(await notice.next_state(0.01, 100_000))
            except Refused as exc:
                got.append(exc.status)
        return got

    first, garbled, none = asyncio.run(run())
    assert first["status"] == "SUCCESS" and first["result"] == {"status": "ok"}
    assert garbled == 502 and none is None  # nothing more was published: read the key
    from fedq.engine.backend import decode_state
    from tests.hostile import UNDECODABLE

    for bad in (b'"text"', *UNDECODABLE):
        with pytest.raises(Refused, match="does not decode") as refused:
            decoded(decode_state, app.backend, bad)
        assert refused.value.status == 502


def test_a_batch_answer_longer_than_its_items_may_have_is_refused_unread(
        redis_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker can store anything under its batch task's key, and the backend
    publishes it: a state longer than ``answer_bytes`` (the batch's items times the
    longest line their op writes) is a 502, neither read from the key (on Redis: a
    script that answers its length) nor decoded from its notice. An honest answer of
    the same batch is within the bound. Drop the bound from ``read_state`` or from
    ``Notice.next_state`` and a refusal below does not happen."""
    import asyncio
    from types import SimpleNamespace

    from celery import Celery

    import fedq.serve.results as serve
    from fedq.engine.backend import RedisBackend
    from fedq.serve.served import answer_bytes

    celery = Celery("test-serve-bound", broker="memory://")
    celery.conf.result_serializer = "json"
    backend = RedisBackend(app=celery, url=redis_db)
    monkeypatch.setattr(serve, "app", SimpleNamespace(backend=backend))
    bound = answer_bytes("classify", 2)
    honest = {"status": "ok", "worker": "w", "seconds": 0.1,
              "outputs": [{"i": i, "label": 0, "probs": [1.0, 0.0, 0.0]} for i in range(2)]}
    backend.store_result("fine", honest, "SUCCESS")
    assert serve.read_state("fine", bound)["result"] == honest
    backend.store_result("huge", {**honest, "error": "x" * bound}, "SUCCESS")
    read: list[Any] = []
    get = backend.client.get
    monkeypatch.setattr(backend.client, "get", lambda *a: read.append(a) or get(*a))
    with pytest.raises(Refused, match=r"bytes, more than the \d+ its items may have") as no:
        serve.read_state("huge", bound)
    assert no.value.status == 502 and read == []  # not a GET: its length only

    async def heard(data: bytes) -> Any:
        notice = serve.Notice()
        notice.states.append(data)
        return await notice.next_state(0.01, bound)

    stored = backend.encode({"status": "SUCCESS", "result": honest, "task_id": "t",
                             "traceback": None, "children": []}).encode()
    assert asyncio.run(heard(stored))["result"] == honest
    with pytest.raises(Refused, match="not read") as no:
        asyncio.run(heard(stored + b" " * bound))
    assert no.value.status == 502


def test_with_identity_a_streamed_piece_counts_only_signed_for_its_task(tmp_path: Path) -> None:
    """Any worker may write the result backend's entries, and a streamed piece reaches
    the user before the signed answer: with identity required, a piece unsigned, signed
    for another task, by an unregistered or a revoked worker, or altered after signing,
    is dropped. Remove the check in stream_texts and this fails."""
    import asyncio

    import fedq.identity as identity
    from fedq.serve.results import _Item, stream_texts

    def worker(name: str) -> identity.Joined:
        key = identity.load_key(tmp_path / f"{name}.key", create=True)
        return identity.Joined(name, key, "", ("cpu",))

    w1, w2, w3 = worker("w1"), worker("w2"), worker("w3")
    registry = identity.Registry({w.name: identity.public_text(w.key) for w in (w1, w2)},
                                 frozenset({"w2"}))
    loop = asyncio.new_event_loop()
    batch = [_Item({"prompt": "p", "max_tokens": 8}, loop.create_future())]
    piece = {"stream": ["to be"]}
    assert stream_texts(w1.sign_result(piece, "t1"), batch, registry, "t1") == ["to be"]
    refused = {
        "unsigned": piece,
        "signed for another task": w1.sign_result(piece, "t0"),
        "by an unregistered worker": w3.sign_result(piece, "t1"),
        "by a revoked worker": w2.sign_result(piece, "t1"),
        "altered": {**w1.sign_result(piece, "t1"), "stream": ["to be, or"]},
        "not a mapping": ["to be"],
    }
    for what, data in refused.items():
        assert stream_texts(data, batch, registry, "t1") == [], what
    assert stream_texts(piece, batch) == ["to be"]  # identity off: shape checks only
    # a piece signed by a worker not registered for the batch's queue is dropped
    bound = identity.Registry(registry.active, registry.revoked,
                              {"w1": frozenset({"cpu"}), "w2": frozenset({"cpu"})})
    signed = w1.sign_result(piece, "t1")
    assert stream_texts(signed, batch, bound, "t1", "cpu") == ["to be"]
    assert stream_texts(signed, batch, bound, "t1", "gpu_new") == []
    loop.close()


def test_the_router_sends_each_batch_where_it_is_expected_back_soonest() -> None:
    """fedq.serve.router.Router: the class order with nothing measured; then the
    measured round trips times the backlog per worker; a faster class that comes is
    tried at once (any queue measured fewer than twice is: the first round trip, cold,
    is replaced by the second); every 20th batch probes the queue measured longest ago."""
    from fedq.serve.router import Router

    r = Router(["gpu_new", "cpu"], live={"cpu": 2})
    assert r.choose() == "cpu"  # the only live queue
    r.done("cpu", 0.5)  # cold: the model loaded on the way
    assert r.choose() == "cpu"
    r.done("cpu", 0.010)
    assert r.to_json()["cpu"]["batch_s"] == 0.01  # the cold round trip is not averaged in
    r.live = {"gpu_new": 1, "cpu": 2}  # a GPU worker came: tried at once, twice
    assert r.best() == "gpu_new" and r.choose() == "gpu_new"
    r.done("gpu_new", 0.9)
    assert r.choose() == "gpu_new"  # its cold round trip is not compared with cpu's
    r.done("gpu_new", 0.004)
    assert r.choose() == "gpu_new"  # measured faster
    r.done("gpu_new", 0.004)
    # the GPU's queue backs up: batches out on its one worker make it the slower bet
    picks = [r.choose() for _ in range(4)]
    # 4 ms x (1 + out): 4, 8, then 12 > the cpu queue's 10 ms (2 workers: 10 x 1.5 next)
    assert picks == ["gpu_new", "gpu_new", "cpu", "gpu_new"], picks
    for q in picks:
        r.done(q, 0.004 if q == "gpu_new" else 0.010)
    # overloaded for real: its round trips grow, and the cpu queue takes the batches
    for _ in range(6):
        r.done("gpu_new", 0.2)
    assert r.best() == "cpu"
    r.sent = Router.PROBE_EVERY - 1  # the next is a probe: the queue measured longest ago
    assert r.choose() == "gpu_new"
    r.done("gpu_new", 0.2)
    assert r.choose() == "cpu"
    r.done("cpu", 0.010)
    r.live = {"gpu_new": 0, "cpu": 0}  # nobody live: the first served queue, not nowhere
    assert r.choose() == "gpu_new"
    # a batch that got no answer counts as the whole timeout
    r.live = {"gpu_new": 1, "cpu": 1}
    r.done("cpu", 30.0)
    assert r.best() == "gpu_new" and r.to_json()["cpu"]["batches"] >= 3


def test_while_every_worker_holds_a_batch_the_next_one_grows() -> None:
    """fedq.serve.batcher.Batcher with one live worker: requests that come while its
    batch is out wait and go together when it comes back (sent every max_wait_ms, they
    would be batches of one queued behind it in the broker); a full batch goes at once;
    a batch waits at most twice the measured round trip. The network part (``_send``)
    is replaced by an answer that comes when the test says."""
    import asyncio
    from dataclasses import replace

    from fedq.serve.batcher import Batcher

    async def scenario(trip_s: float) -> list[int]:
        batcher = Batcher(replace(SERVED, max_batch=4, max_wait_ms=5))
        assert batcher.router is not None
        batcher.router.live = {"cpu": 1}
        batcher.router.ewma = {"cpu": trip_s}
        back = asyncio.Event()
        sizes: list[int] = []

        async def send(batch: list[Any], attempt: int) -> list[dict[str, Any]]:
            sizes.append(len(batch))
            await back.wait()
            return [{}] * len(batch)

        batcher._send = send  # type: ignore[method-assign]
        runner = asyncio.create_task(batcher.run())
        futures = [i.future for i in batcher.admit([{}])]
        await asyncio.sleep(0.02)  # the first batch is out: the worker is busy
        for _ in range(3):  # one every 20 ms, four times max_wait_ms apart
            futures += [i.future for i in batcher.admit([{}])]
            await asyncio.sleep(0.02)
        if trip_s < 1:  # a short round trip measured: the batch goes without the answer
            for _ in range(500):
                if len(sizes) == 2:
                    break
                await asyncio.sleep(0.01)
        back.set()
        await asyncio.gather(*futures)
        back.clear()  # a burst over max_batch: full batches go while one is out
        futures = [i.future for i in batcher.admit([{}] * 9)]
        await asyncio.sleep(0.05)
        sizes.append(0)  # what was sent before the answer came
        back.set()
        await asyncio.gather(*futures)
        runner.cancel()
        return sizes

    # the three waited for the first batch to come back; then full batches, and the
    # ninth item when they came back
    assert asyncio.run(scenario(10.0)) == [1, 3, 4, 4, 0, 1]
    # a 0.25 s round trip measured: the three went after at most 0.5 s, unanswered
    assert asyncio.run(scenario(0.25)) == [1, 3, 4, 4, 0, 1]
    # a worker that runs two tasks at once takes two batches (Celery's stats say so)
    busy = Batcher(SERVED)
    assert busy.router is not None
    busy.router.live, busy.router.slots = {"cpu": 1}, {"cpu": 2}
    assert busy.capacity() == 2


def test_a_dispatch_that_fails_any_way_answers_within_the_batch_timeout() -> None:
    """fedq.serve.batcher.Batcher._dispatch: a send that raises anything (the broker
    away: kombu's OperationalError) is a 502 for the batch's requests, and a send that
    never returns (a publish retrying against a dead broker) a 504 after the batch
    timeout and its grace, each attempt; never a request left waiting. Catch only
    Refused again (as before) and the first raises through; drop the wait_for and the
    second waits for ever."""
    import asyncio
    import time
    from dataclasses import replace

    from kombu.exceptions import OperationalError

    from fedq.serve.batcher import Batcher
    from fedq.serve.served import SEND_GRACE_S

    async def scenario(send: Any) -> tuple[int, float]:
        batcher = Batcher(replace(SERVED, batch_timeout_s=0.2))
        assert batcher.router is not None
        batcher.router.live = {"cpu": 1}
        batcher._send = send  # type: ignore[method-assign]
        runner = asyncio.create_task(batcher.run())
        began = time.monotonic()
        item = batcher.admit([{}])
        assert item is not None
        try:
            await item[0].future
        except Refused as exc:
            return exc.status, time.monotonic() - began
        finally:
            runner.cancel()
        raise AssertionError("answered")

    async def broker_away(batch: list[Any], attempt: int) -> list[dict[str, Any]]:
        raise OperationalError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    async def hangs(batch: list[Any], attempt: int) -> list[dict[str, Any]]:
        await asyncio.Event().wait()
        return []

    status, took = asyncio.run(scenario(broker_away))
    assert status == 502 and took < 5, (status, took)
    status, took = asyncio.run(asyncio.wait_for(scenario(hangs), 30))
    assert status == 504 and took <= 2 * (0.2 + SEND_GRACE_S) + 2, (status, took)


def test_requests_and_answers_are_checked() -> None:
    assert parse_predict({"inputs": [[[[1, 2], [3, 4]]], [0.5, 0, 0, 1]]}, SERVED) == \
        [[1.0, 2.0, 3.0, 4.0], [0.5, 0.0, 0.0, 1.0]]
    for bad in ({"inputs": [[1, 2, 3]]}, {"inputs": [[1, 2, 3, "x"]]}, {"inputs": []},
                {"inputs": [[1, 2, 3, float("nan")]]}, {"inputs": [[1, 2, 3, 4]], "x": 1}, []):
        with pytest.raises(ValueError):
            parse_predict(bad, SERVED)
    gpt = Served(**{**SERVED.__dict__, "op": "generate"})
    assert parse_completion({"prompt": "Hi", "max_tokens": 4}, gpt)[0]["max_tokens"] == 4
    # a list of prompts, n of each (item k of a prompt: seed + k), prompt by prompt
    items = parse_completion({"prompt": ["a", "b"], "n": 2, "seed": 7}, gpt)
    assert [(i["prompt"], i["seed"]) for i in items] == [("a", 7), ("a", 8), ("b", 7), ("b", 8)]
    for bad_c in ({"prompt": 3}, {"prompt": "a", "max_tokens": 0}, {"prompt": "a", "top_k": -1},
                  {"prompt": "a", "temperature": 0}, {"prompt": "a", "stream": "yes"},
                  {"prompt": "a", "n": 0}, {"prompt": ["a", 1]}, {"prompt": []},
                  {"prompt": "a", "stop": ["x"] * 5}, {"prompt": "a", "stop": [""]},
                  {"prompt": ["a", "b"], "stream": True}, {"prompt": "a", "n": 2, "stream": True},
                  {"prompt": "a", "stream_options": {"include_usage": True}},
                  {"prompt": "a", "stream": True, "stream_options": {"usage": True}},
                  {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}}):
        with pytest.raises(ValueError):
            parse_completion(bad_c, gpt)
    # a field of OpenAI's API fedq does not take is refused by name, never ignored
    for field in ("echo", "logprobs", "top_p", "best_of", "suffix"):
        with pytest.raises(ValueError, match=f"{field}: not supported by fedq serve"):
            parse_completion({"prompt": "a", field: 1}, gpt)
    assert stopped("to be, or not", [", ", "not"]) == ("to be", "stop")
    assert stopped("to be", ["xyz"]) == ("to be", "length")
    good = {"status": "ok", "worker": "w", "seconds": 0.1,
            "outputs": [{"i": 0, "label": 2, "probs": [0.1, 0.2, 0.7]}]}
    assert check_batch(good, SERVED, 1) == [{"label": 2, "probs": [0.1, 0.2, 0.7]}]
    for wrong in ({**good, "outputs": []}, {**good, "status": "error"}, {**good, "extra": 1},
                  {**good, "outputs": [{"i": 0, "label": 5, "probs": [0.1, 0.2, 0.7]}]}):
        with pytest.raises(Refused):
            check_batch(wrong, SERVED, 1)
    # /v1/embeddings: a string or a list of strings; answers of the model's width
    assert parse_embeddings({"input": "Hi"}, gpt) == ["Hi"]
    assert parse_embeddings({"input": ["a", "b"], "model": "m"}, gpt) == ["a", "b"]
    for bad_e in ({"input": 3}, {"input": []}, {"input": ["a", 1]}, {"prompt": "a"},
                  {"input": "a", "stream": True}, {"input": "x" * 20_000}):
        with pytest.raises(ValueError):
            parse_embeddings(bad_e, gpt)
    wide = Served(**{**gpt.__dict__, "width": 2})
    unit = {"status": "ok", "worker": "w", "seconds": 0.1,
            "outputs": [{"i": 0, "embedding": [0.6, 0.8]}]}
    assert check_batch(unit, wide, 1, op="embed") == [{"embedding": [0.6, 0.8]}]
    # a generated text no longer than its item's max_tokens (remove the length check in
    # protocol.inference.check_output, or the bounds check_batch passes, and this fails)
    text = {"status": "ok", "worker": "w", "seconds": 0.1,
            "outputs": [{"i": 0, "text": "abcd"}, {"i": 1, "text": "x" * 4000}]}
    assert len(check_batch(text, gpt, 2, op="generate", max_tokens=[4, 4000])) == 2
    with pytest.raises(Refused, match="4000 characters, more than its max_tokens 4") as long:
        check_batch(text, gpt, 2, op="generate", max_tokens=[4000, 4])
    record("security", scenario="outputs: a text longer than max_tokens",
           did="answered a batch's item of max_tokens 4 with 4,000 characters",
           fedq=f"refused: {str(long.value)[:100]}",
           guard="protocol.inference.check_output (batch jobs' shards and fedq serve's batches)",
           outcome="502 for the batch's requests; a shard is sent again")
    with pytest.raises(Refused, match="more than its max_tokens 256"):  # the served bound
        check_batch(text, gpt, 2, op="generate")
    with pytest.raises(Refused, match="numbers of unit length"):
        check_batch({**unit, "outputs": [{"i": 0, "embedding": [0.6, 0.8, 0.0]}]}, wide, 1,
                    op="embed")


def _post(port: int, path: str, body: Any, key: str | None = None,
          timeout: float = 60) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def _sse(port: int, path: str, body: Any) -> list[str]:
    """The ``data:`` fields of a server-sent event stream, read to its end."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = resp.read().decode()
    return [block[len("data: "):] for block in text.split("\n\n") if block.strip()]


class Gateway:
    def __init__(self, cluster: Cluster, args: list[str], queues: str = "cpu",
                 **env: str) -> None:
        self.port = free_port()
        self.log = cluster.home / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedq.cli", "serve", *args, "--port", str(self.port),
             "--queues", queues], env={**cluster.env, **env}, stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT, start_new_session=True)

        def up() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return True
            except OSError:
                assert self.proc.poll() is None, self.log.read_text()
                return False

        wait_until(up, 60, what=lambda: f"fedq serve to listen\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def weights(tmp_path: Path) -> Iterator[Path]:
    ds = load_dataset("digits")
    path = tmp_path / "cnn.safetensors"
    path.write_bytes(dumps(state_of(seeded_model("small_cnn", ds.input_shape, ds.num_classes,
                                                 3))))
    yield path


def _reference(weights: Path, x: torch.Tensor) -> list[list[float]]:
    ds = load_dataset("digits")
    model = build_model("small_cnn", ds.input_shape, ds.num_classes)
    model.load_state_dict(loads(weights.read_bytes()))
    with torch.no_grad():
        return F.softmax(model.eval()(x), dim=-1).tolist()


@pytest.mark.slow
def test_served_requests_are_batched_bounded_and_survive_a_stopped_worker(
        redis_cluster: Cluster, weights: Path) -> None:
    cluster = redis_cluster
    cluster.start(w1=["cpu"], w2=["cpu"])
    args = ["--weights", str(weights), "--model", "small_cnn", "--dataset", "digits"]
    # 10 s a batch: the first batch of each worker loads the model, which took more
    # than 3 s twice over (both attempts) on a busy 2-core machine
    gateway = Gateway(cluster, [*args, "--max-batch", "8", "--max-wait-ms", "50",
                                "--batch-timeout-s", "10"], FEDQ_SERVE_API_KEY="k3y")
    try:
        # uvicorn[standard]'s parser and loop (docs/inference.md measured them against h11)
        assert "HTTP: httptools on uvloop" in gateway.log.read_text()
        x = load_dataset("digits").x_test[:32]
        want = _reference(weights, x)
        status, body, _ = _post(gateway.port, "/v1/predict", {"inputs": [x[0].tolist()]})
        assert status == 401 and "API key" in body["error"]["message"]
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: _post(gateway.port, "/v1/predict",
                                                    {"inputs": [x[i].tolist()]}, "k3y"),
                                    range(32)))
        assert [s for s, _, _ in answers] == [200] * 32, answers[:2]
        for i, (_, body, _) in enumerate(answers):
            got = body["predictions"][0]["probs"]
            assert max(abs(a - b) for a, b in zip(got, want[i])) <= 1e-5
        sizes = [body["batch_sizes"][0] for _, body, _ in answers]
        assert max(sizes) > 1 and max(sizes) <= 8, sizes  # batched, within --max-batch
        # the answers were found by the result backend's notices and taken from the
        # notices themselves (no read of the key). Not every one: a waiter that heard
        # nothing for 50 ms reads the key, and on a loaded machine that read can find
        # the answer before its notice arrives (CI, 2026-11-29: 3 of at least 4 batches)
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.port}/health") as resp:
            health = json.loads(resp.read())
        assert health["results"] == "notified" and health["notices"] >= 1, health
        assert health["from_notices"] >= 1, health
        # a worker stopped while it holds a batch: the batch goes out again. w2 gone and
        # w1 stopped, w1's waiting read takes attempt 1 and holds it; once the gateway
        # has sent attempt 2, w1 goes on and answers it (its late attempt 1 is ignored).
        cluster.by_name("w2").kill()
        w1 = cluster.by_name("w1")
        assert w1.proc is not None
        os.killpg(w1.proc.pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                late = pool.submit(_post, gateway.port, "/v1/predict",
                                   {"inputs": [x[0].tolist()]}, "k3y")
                wait_until(lambda: "attempt 1: no answer within 10s" in gateway.log.read_text(),
                           40, what=lambda: f"the batch's first attempt to time out\n"
                                            f"{gateway.log.read_text()}")
                os.killpg(w1.proc.pid, signal.SIGCONT)
                status, body, _ = late.result(timeout=30)
            assert status == 200, body
        finally:
            os.killpg(w1.proc.pid, signal.SIGCONT)
        metrics = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{gateway.port}/metrics",
            headers={"Authorization": "Bearer k3y"}), timeout=5).read().decode()
        assert "fedq_serve_batch_size_count" in metrics
        assert "fedq_serve_request_seconds_bucket" in metrics
    finally:
        gateway.stop()
    # past its bound, and with no worker to answer: 503 with Retry-After, then 504
    cluster.by_name("w1").kill()
    cluster.by_name("w2").kill()
    gateway = Gateway(cluster, [*args, "--max-queue", "2", "--max-wait-ms", "200",
                                "--batch-timeout-s", "1", "--read-timeout-s", "2"])
    try:
        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(lambda i: _post(gateway.port, "/v1/predict",
                                                    {"inputs": [x[i].tolist()]}), range(5)))
        codes = sorted(s for s, _, _ in answers)
        assert codes == [503, 503, 503, 504, 504], codes
        busy = next(h for s, _, h in answers if s == 503)
        assert {k.lower(): v for k, v in busy.items()}.get("retry-after") == "1"
        _bodies_are_bounded(gateway)
    finally:
        gateway.stop()
    bad = cluster.fedq("serve", *args, "--queues", "gpu9", check=False)
    assert bad.returncode == 2 and "--queues: gpu9" in bad.stderr and "Traceback" not in bad.stderr


def _raw(port: int, head: bytes, chunks: Iterator[bytes], pause_s: float = 0.0
         ) -> tuple[int, float]:
    """Send ``head`` then ``chunks`` (pausing ``pause_s`` after the first) on one
    connection, while another thread reads the answer; its status code and the seconds
    it took, whether or not the server read the whole body."""
    import socket
    import threading
    import time

    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    got: list[bytes] = []
    answered: list[float] = []

    def read() -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                got.append(data)
                if b"\r\n" in b"".join(got):
                    answered.append(time.monotonic())
                    return

    began = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with contextlib.suppress(OSError):
        conn.sendall(head)
        for n, chunk in enumerate(chunks):
            if not reader.is_alive():
                break  # answered: stop sending
            conn.sendall(chunk)
            if n == 0 and pause_s:
                reader.join(pause_s)  # the pause, cut short by an answer
    reader.join(30)
    took = (answered[0] if answered else time.monotonic()) - began
    conn.close()
    line = b"".join(got).split(b"\r\n", 1)[0].split()
    return (int(line[1]) if len(line) > 1 else 0), took


def _bodies_are_bounded(gateway: Gateway) -> None:
    """What the gateway reads of a request is bounded (fedq.serve.bounds.read_json):
    a 128 MiB body, declared or chunked, is refused (413) long before it is read; a body
    that stops arriving is refused (408) after --read-timeout-s; JSON nested 100,000
    deep is a 400, never a 500. Remove the bound or the timeout and this fails."""

    size = 128 << 20
    mib = b"x" * (1 << 20)
    declared = (f"POST /v1/predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                f"\r\nContent-Length: {size}\r\n\r\n").encode()
    status, took = _raw(gateway.port, declared, iter([mib] * 128))
    assert status == 413, status
    chunked = (b"POST /v1/predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
               b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = f"{len(mib):x}\r\n".encode() + mib + b"\r\n"
    status, took = _raw(gateway.port, chunked, iter([piece] * 128))
    assert status == 413, status
    record("security", scenario="gateway: a 128 MiB request body",
           did="POST /v1/predict with 128 MiB, declared and chunked",
           fedq="413 after at most the largest legal request's bytes (read_json)",
           guard="serve.read_json: the body limit", outcome="refused, nothing parsed")
    slow = (b"POST /v1/predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
            b"\r\nContent-Length: 1000\r\n\r\n")
    status, took = _raw(gateway.port, slow, iter([b'{"inputs": ', b"[1]}"]), pause_s=60)
    assert status == 408 and took < 30, (status, took)
    record("security", scenario="gateway: a body that stops arriving",
           did="declares 1,000 bytes, sends 11, then waits",
           fedq="408 after --read-timeout-s (2 s here)",
           guard="serve.read_json: the read timeout", outcome="the connection freed")
    deep = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body, _ = _post_raw(gateway.port, "/v1/predict", deep)
    assert status == 400 and "nests deeper" in body["error"]["message"], (status, body)
    record("security", scenario="gateway: JSON nested 100,000 deep",
           did="POST /v1/predict with a list nested 100,000 deep",
           fedq="400: the request's JSON nests deeper than 16",
           guard="serve.read_json: the nesting bound", outcome="refused, no 500")


def _post_raw(port: int, path: str, data: bytes) -> tuple[int, dict[str, Any], Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def test_each_user_has_an_api_key_of_their_own_and_a_revoked_one_is_refused(
        tmp_path: Path, weights: Path) -> None:
    """`fedq serve-key add/list/revoke` (fedq/serve/keys.py) on the embedded default:
    once a key exists the gateway takes only an active key; a revoked key is refused
    within a few seconds, and revoking the last key leaves the gateway closed, not open.
    Remove the key table from `authorised` and this fails."""
    import time

    from fedq.testing.cluster import base_env

    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    (tmp_path / "logs").mkdir(exist_ok=True)
    made = cluster.fedq("serve-key", "add", "alice")
    alice = made.stdout.strip()
    assert alice.startswith("fedq-") and len(alice) > 40 and "\n" not in alice
    again = cluster.fedq("serve-key", "add", "alice", check=False)
    assert again.returncode != 0 and again.stderr.count("\n") == 1 and "exists" in again.stderr
    bad = cluster.fedq("serve-key", "add", "Alice Smith", check=False)
    assert bad.returncode != 0 and "key name" in bad.stderr and "Traceback" not in bad.stderr
    gateway = Gateway(cluster, ["--weights", str(weights), "--model", "small_cnn",
                                "--dataset", "digits"])

    def status(key: str | None) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{gateway.port}/metrics",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    try:
        assert status(alice) == 200
        assert status(None) == 401 and status("fedq-" + "x" * 43) == 401
        cluster.fedq("serve-key", "revoke", "alice")
        deadline = time.monotonic() + 15
        while status(alice) != 401 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status(alice) == 401 and status(None) == 401  # closed, not open
    finally:
        gateway.stop()
    listed = cluster.fedq("serve-key", "list").stdout
    assert "alice" in listed and listed.count("-") >= 2, listed
    gone = cluster.fedq("serve-key", "revoke", "bob", check=False)
    assert gone.returncode == 4 and "no serve key bob" in gone.stderr


@pytest.mark.slow
def test_served_batches_go_where_they_come_back_soonest(redis_cluster: Cluster,
                                                         weights: Path) -> None:
    """Two served queues: gpu_new, whose one worker is slowed 100x, and cpu. The class
    order alone would send every batch to gpu_new; the router measures both and sends
    most to cpu, probing gpu_new now and then (/health's routes). The cpu worker runs two
    tasks at once, and counts so in the batches the gateway keeps out."""
    cluster = redis_cluster
    cluster.add("slow", ["gpu_new"], FEDQ_TEST_SLOWDOWN="100", FEDQ_SKIP_HARDWARE_CHECK="1")
    fast = cluster.worker("fast", ["cpu"])
    fast.concurrency, fast.pool = 2, "threads"  # two tasks at once
    start_workers([fast])
    cluster.workers.append(fast)
    gateway = Gateway(cluster, ["--weights", str(weights), "--model", "small_cnn",
                                "--dataset", "digits"], queues="gpu_new,cpu")
    try:
        def routes() -> dict[str, Any]:
            with urllib.request.urlopen(f"http://127.0.0.1:{gateway.port}/health") as resp:
                return json.loads(resp.read())["routes"]

        wait_until(lambda: all(r["live_workers"] for r in routes().values()), 60,
                   what="both queues' workers to be seen live")
        assert {q: (r["live_workers"], r["slots"]) for q, r in routes().items()} == \
            {"gpu_new": (1, 1), "cpu": (1, 2)}
        x = load_dataset("digits").x_test[:1]
        for _ in range(40):  # one at a time: each batch's round trip is measured alone
            status, body, _ = _post(gateway.port, "/v1/predict", {"inputs": [x[0].tolist()]})
            assert status == 200, body
        seen = routes()
        assert seen["gpu_new"]["batches"] >= 1 and seen["cpu"]["batches"] >= 30, seen
        assert seen["gpu_new"]["batch_s"] > 5 * seen["cpu"]["batch_s"], seen
    finally:
        gateway.stop()


@pytest.mark.slow
def test_a_served_gpt_completes_and_embeds(redis_cluster: Cluster, tmp_path: Path) -> None:
    """A GPT behind the gateway: /v1/completions and /v1/embeddings (batched apart: one
    operation a batch) answer on a real worker, the embeddings equal to the model's in
    one process; a classifier has no /v1/embeddings."""
    from fedq.data import text as text_data
    from tests.test_inference import SMALL_TEXT, TINY_GPT, _gpt, _gpt_file

    cluster = redis_cluster
    cluster.start(w1=["cpu"])
    weights = _gpt_file(tmp_path)
    gateway = Gateway(cluster, ["--weights", str(weights), "--model", "gpt", "--dataset",
                                "shakespeare", "--model-args", json.dumps(TINY_GPT),
                                "--dataset-args", json.dumps(SMALL_TEXT)])
    try:
        status, body, _ = _post(gateway.port, "/v1/completions",
                                {"prompt": "Good my lord", "max_tokens": 5, "seed": 1})
        assert status == 200 and body["object"] == "text_completion", body
        assert 0 < len(body["choices"][0]["text"]) <= 5  # 5 bytes (an untrained model's)
        made = len(body["choices"][0]["text"].encode())  # a byte a token
        assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": made,
                                 "total_tokens": 12 + made}, body
        # a list of prompts and n of each: one choice per prompt and sample, in order,
        # sample k of a prompt with seed + k (the text that seed gets alone)
        many = {"prompt": ["Good my lord", "To be"], "n": 2, "max_tokens": 8, "seed": 1}
        status, body, _ = _post(gateway.port, "/v1/completions", many)
        assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3], body
        alone = _post(gateway.port, "/v1/completions",
                      {"prompt": "To be", "max_tokens": 8, "seed": 2})[1]
        assert body["choices"][3]["text"] == alone["choices"][0]["text"]
        assert body["usage"]["prompt_tokens"] == 12 + 5
        # stop: each text cut before the first stop sequence in it, finish_reason "stop"
        whole = body["choices"][0]["text"]
        if len(whole) >= 2:
            cut = whole[1]
            status, stop, _ = _post(gateway.port, "/v1/completions",
                                    {"prompt": "Good my lord", "max_tokens": 8, "seed": 1,
                                     "stop": cut})
            assert status == 200 and stop["choices"][0] == {
                "text": whole[:whole.find(cut)], "index": 0, "logprobs": None,
                "finish_reason": "stop"}, (whole, stop)
        status, refused, _ = _post(gateway.port, "/v1/completions",
                                   {"prompt": "a", "echo": True})
        assert status == 400 and "echo: not supported" in refused["error"]["message"]
        # streamed (server-sent events): pieces while the worker generates, which add up
        # to the text the same request gets whole, then the finish and [DONE]
        ask = {"prompt": "Good my lord", "max_tokens": 256, "seed": 3}
        status, whole, _ = _post(gateway.port, "/v1/completions", ask)
        assert status == 200, whole
        events = _sse(gateway.port, "/v1/completions", {**ask, "stream": True})
        assert events[-1] == "[DONE]", events
        pieces = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert len(pieces) >= 2 and all(p["finish_reason"] is None for p in pieces[:-1])
        assert pieces[-1]["finish_reason"] == "length"
        assert "".join(p["text"] for p in pieces) == whole["choices"][0]["text"]
        texts = ["Good my lord", "", "It is a wise father that knows his own child. " * 2]
        status, body, _ = _post(gateway.port, "/v1/embeddings", {"input": texts})
        assert status == 200 and body["object"] == "list", body
        model = _gpt(weights)
        for row, text in zip(body["data"], texts, strict=True):
            ids = text_data.prompt_ids(text)
            with torch.no_grad():
                total = sum(model.features(ids[lo:lo + 32][None])[0].double().sum(0)
                            for lo in range(0, len(ids), 32))
            assert torch.allclose(torch.tensor(row["embedding"], dtype=torch.float64),
                                  F.normalize(total, dim=-1), atol=1e-5), text
        assert [row["index"] for row in body["data"]] == [0, 1, 2]
        size = sum(len(t.encode()) for t in texts)
        assert body["usage"] == {"prompt_tokens": size, "total_tokens": size}
        # OpenAI's clients send encoding_format (base64 by default in its Python client):
        # float is the same answer, base64 the same numbers as little-endian float32
        import base64
        import struct

        floats = [row["embedding"] for row in body["data"]]
        status, same, _ = _post(gateway.port, "/v1/embeddings",
                                {"input": texts, "encoding_format": "float", "user": "u1"})
        assert status == 200 and [r["embedding"] for r in same["data"]] == floats, same
        status, packed, _ = _post(gateway.port, "/v1/embeddings",
                                  {"input": texts, "encoding_format": "base64"})
        assert status == 200, packed
        for row, want in zip(packed["data"], floats, strict=True):
            raw = base64.b64decode(row["embedding"])
            got = struct.unpack(f"<{len(raw) // 4}f", raw)
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-6
        status, refused, _ = _post(gateway.port, "/v1/embeddings",
                                   {"input": texts, "dimensions": 8})
        assert status == 400 and "dimensions: not supported" in \
            refused["error"]["message"], refused
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.port}/v1/models",
                                    timeout=10) as resp:
            listed = json.loads(resp.read())
        assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == \
            [str(weights)], listed
        status, body, _ = _post(gateway.port, "/v1/predict", {"inputs": [[0.0]]})
        assert status == 404 and "/v1/completions" in body["error"]["message"]
        assert body["error"]["type"] == "not_found_error", body
        _openai_client_gets_the_same(gateway.port, str(weights), many, texts, floats,
                                     ask, whole["choices"][0]["text"])
    finally:
        gateway.stop()


def _openai_client_gets_the_same(port: int, model: str, many: dict[str, Any],
                                 texts: list[str], floats: list[list[float]],
                                 ask: dict[str, Any], streamed: str) -> None:
    """OpenAI's own Python client (what most programs that speak to an OpenAI-compatible
    server use) against the gateway: a list of prompts with n, a stream, embeddings in
    the client's default base64, the model list, and a refused field as the client's
    BadRequestError carrying OpenAI's error object."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=60)
    got = client.completions.create(model=model, **many)
    direct = _post(port, "/v1/completions", many)[1]
    assert [c.text for c in got.choices] == [c["text"] for c in direct["choices"]]
    assert got.usage is not None and got.usage.prompt_tokens == 12 + 5
    pieces = list(client.completions.create(model=model, stream=True, **ask))
    assert "".join(chunk.choices[0].text for chunk in pieces) == streamed
    counted = list(client.completions.create(model=model, stream=True, **ask,
                                             stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in counted if c.choices) == streamed
    assert not counted[-1].choices and counted[-1].usage is not None
    assert (counted[-1].usage.prompt_tokens, counted[-1].usage.completion_tokens) == (
        len(ask["prompt"].encode()), len(streamed.encode()))
    embedded = client.embeddings.create(model=model, input=texts)
    for row, want in zip(embedded.data, floats, strict=True):
        assert max(abs(a - b) for a, b in zip(row.embedding, want, strict=True)) < 1e-6
    assert [m.id for m in client.models.list()] == [model]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="a", echo=True)
    assert refused.value.status_code == 400 and refused.value.type == "invalid_request_error"
    assert "echo: not supported" in refused.value.message


def test_serve_in_a_fresh_folder_migrates_the_embedded_default(tmp_path: Path,
                                                                weights: Path) -> None:
    """`fedq serve --weights ...` where nothing ran before: the embedded default's
    database is made on the way (its API keys live there), as `fedq submit` makes it.
    Without ensure_schema in prepare it stopped with `no such table: serve_keys`."""
    from fedq.testing.cluster import base_env

    home = tmp_path / "fresh" / ".fedq"
    home.parent.mkdir()
    cluster = Cluster(home.parent, base_env(home))
    gateway = Gateway(cluster, ["--weights", str(weights), "--model", "small_cnn",
                                "--dataset", "digits"])
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.port}/health",
                                    timeout=10) as resp:
            assert json.loads(resp.read())["status"] == "ok"
        assert (home / "fedq.db").exists()
    finally:
        gateway.stop()
