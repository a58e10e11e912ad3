"""The Starlette application of ``fedq serve`` (:class:`Gateway`), what it serves
(:func:`prepare`) and running it (:func:`run`)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import fedq.identity as identity
from fedq.engine.app import app
from fedq.serve.batcher import Batcher, _Metrics
from fedq.serve.bounds import BadBody, read_json
from fedq.serve.openai import (
    embedding_out,
    error_object,
    include_usage,
    parse_chat,
    parse_completion,
    parse_embeddings,
    parse_predict,
    parse_stops,
    stopped,
    usage,
)
from fedq.serve.results import _Item, chat_choice, result_watch, stream_events
from fedq.serve.served import KEYS_EVERY_S, ROUTE_EVERY_S, Refused, Served

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger(__name__)


UNAUTHORISED = "missing or wrong API key (Authorization: Bearer KEY)"


class Gateway:
    """The HTTP side of ``fedq serve`` for one :class:`Served` model: one
    :class:`Batcher` for its operation (and one for embeddings when a language model
    has them), a handler per route, and the lifespan that runs the batchers, the
    result notices and the loop that re-reads routes and API keys. :attr:`app` is the
    Starlette application."""

    def __init__(self, served: Served) -> None:
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.served = served
        self.batcher = Batcher(served)
        try:
            self.batcher.metrics = _Metrics()
        except ImportError:  # prometheus-client (fedq[metrics]) not installed: no /metrics
            self.batcher.metrics = None
        # a language model also embeds: its own batches (one op a batch), the same bound
        self.embedder = Batcher(served, op="embed", metrics=self.batcher.metrics) \
            if served.width else None
        self.batchers = [b for b in (self.batcher, self.embedder) if b is not None]
        self.started = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/predict", self.predict, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/health", self.health), Route("/metrics", self.metrics)],
            lifespan=self.lifespan)
        self.app.state.batcher = self.batcher

    # -- what every route shares ----------------------------------------------------------

    @staticmethod
    def error(status: int, message: str, **headers: str) -> Response:
        from starlette.responses import JSONResponse

        return JSONResponse(error_object(status, message), status_code=status,
                            headers=headers or None)

    def authorised(self, request: Request) -> bool:
        """The shared key (FEDQ_SERVE_API_KEY), or an active key of `fedq serve-key`;
        once either exists, nothing else passes."""
        from fedq.serve.keys import digest

        served, table = self.served, self.served.key_table
        if served.api_key is None and (table is None or not table.required):
            return True
        given = request.headers.get("authorization", "")
        if not given.startswith("Bearer "):
            return False
        token = given[len("Bearer "):]
        if served.api_key is not None and hmac.compare_digest(token.encode(),
                                                              served.api_key.encode()):
            return True
        return table is not None and digest(token) in table.active

    async def answer(self, request: Request, route: str, parse: Any, shape: Any,
                     via: Batcher | None = None, stream: Any = None) -> Response:
        """Parse, admit and wait; ``stream(item, start, include_usage)``: the response
        for a request that asked for a stream (its one item is queued with a stream of its
        own)."""
        from starlette.responses import JSONResponse

        via = via or self.batcher
        metrics = self.batcher.metrics
        start = time.perf_counter()
        if not self.authorised(request):
            return self.error(401, UNAUTHORISED)
        try:
            body = await read_json(request, self.served.body_limit,
                                   self.served.read_timeout_s)
            items = parse(body, self.served)
        except BadBody as exc:
            return self.error(exc.status, str(exc))
        except ValueError as exc:
            return self.error(400, str(exc))
        streamed = stream is not None and body.get("stream") is True
        bodies = items if isinstance(items, list) else [items]
        admitted = via.admit(bodies, stream=streamed)
        if admitted is None:
            if metrics is not None:
                metrics.rejected.inc()
            return self.error(503, f"busy: {via.pending} items waiting or out (at most "
                              f"{self.served.max_queue})", **{"Retry-After": "1"})
        if metrics is not None:
            metrics.pending.set(sum(b.pending for b in self.batchers))
        if streamed:
            return stream(admitted[0], start, include_usage(body))
        try:
            done = await asyncio.gather(*(item.future for item in admitted))
        except Refused as exc:
            return self.error(exc.status, str(exc))
        self.observe(route, start)
        return JSONResponse(shape(done))

    def observe(self, route: str, start: float) -> None:
        if self.batcher.metrics is not None:
            self.batcher.metrics.latency.labels(route).observe(time.perf_counter() - start)

    # -- the routes ------------------------------------------------------------------------

    async def predict(self, request: Request) -> Response:
        served = self.served
        if served.op != "classify":
            return self.error(404, f"{served.name} is a language model: POST /v1/completions")
        return await self.answer(request, "predict", parse_predict, lambda done: {
            "model": served.name, "predictions": [out for out, _ in done],
            "batch_sizes": [n for _, n in done]})

    async def completions(self, request: Request) -> Response:
        served = self.served
        if served.op != "generate":
            return self.error(404, f"{served.name} is a classifier: POST /v1/predict")
        asked: list[tuple[list[str], list[str]]] = []  # (each prompt once, stops)

        def parse(body: Any, s: Served) -> list[dict[str, Any]]:
            items = parse_completion(body, s)
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            asked.append((prompts, parse_stops(body)))
            return items

        def shape(done: list[tuple[dict[str, Any], int]]) -> dict[str, Any]:
            prompts, stops = asked[0]
            texts, choices = [], []
            for k, (out, _) in enumerate(done):
                text, finish = stopped(out["text"], stops)
                texts.append(text)
                choices.append({"text": text, "index": k, "logprobs": None,
                                "finish_reason": finish})
            return {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion",
                    "created": int(time.time()), "model": served.name, "choices": choices,
                    "usage": usage(prompts, texts, served.count_tokens),
                    "batch_size": done[0][1]}

        def stream(item: _Item, start: float, with_usage: bool) -> Response:
            return self.streamed(item, start, with_usage, asked[0][1], "completions")

        return await self.answer(request, "completions", parse, shape, stream=stream)

    async def chat_completions(self, request: Request) -> Response:
        served = self.served
        if served.op != "generate":
            return self.error(404, f"{served.name} is a classifier: POST /v1/predict")
        if served.chat is None:
            return self.error(404, f"{served.name}'s tokenizer has no chat template: POST "
                                   "/v1/completions")
        asked: list[tuple[str, list[str]]] = []  # (the rendered prompt, stops)

        def parse(body: Any, s: Served) -> list[dict[str, Any]]:
            items, prompt, stops = parse_chat(body, s)
            asked.append((prompt, stops))
            return items

        def shape(done: list[tuple[dict[str, Any], int]]) -> dict[str, Any]:
            prompt, stops = asked[0]
            texts, choices = [], []
            for k, (out, _) in enumerate(done):
                text, finish = stopped(out["text"], stops)
                texts.append(text)
                choices.append({"index": k, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": finish})
            return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion",
                    "created": int(time.time()), "model": served.name, "choices": choices,
                    "usage": usage([prompt], texts, served.count_tokens),
                    "batch_size": done[0][1]}

        def stream(item: _Item, start: float, with_usage: bool) -> Response:
            return self.streamed(item, start, with_usage, asked[0][1], "chat")

        return await self.answer(request, "chat", parse, shape, stream=stream)

    def streamed(self, item: _Item, start: float, with_usage: bool, stops: list[str],
                 route: str) -> Response:
        """A streamed completion's (or chat completion's) server-sent events
        (:func:`stream_events`)."""
        from starlette.responses import StreamingResponse

        chat = route == "chat"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.served.name}
        more: dict[str, Any] = {"choice": chat_choice} if chat else {}

        async def events() -> AsyncIterator[str]:
            async for event in stream_events(item, head, with_usage, stops,
                                             count=self.served.count_tokens, **more):
                yield event
            self.observe(route, start)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def embeddings(self, request: Request) -> Response:
        served = self.served
        if self.embedder is None:
            return self.error(404, f"{served.name} is a classifier: POST /v1/predict")
        encoding: list[str] = []
        tokens: list[int] = []

        def parse(body: Any, s: Served) -> list[str]:
            texts = parse_embeddings(body, s)
            encoding.append(body.get("encoding_format", "float"))
            tokens.append(sum(map(s.count_tokens, texts)))
            return texts

        return await self.answer(request, "embeddings", parse, lambda done: {
            "object": "list", "model": served.name,
            "data": [{"object": "embedding", "index": k,
                      "embedding": embedding_out(out["embedding"], encoding[0])}
                     for k, (out, _) in enumerate(done)],
            "usage": {"prompt_tokens": tokens[0], "total_tokens": tokens[0]},
            "batch_sizes": [n for _, n in done]}, self.embedder)

    async def models(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        if not self.authorised(request):
            return self.error(401, UNAUTHORISED)
        return JSONResponse({"object": "list", "data": [
            {"id": self.served.name, "object": "model", "created": self.started,
             "owned_by": "fedq"}]})

    async def health(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        batcher, batchers = self.batcher, self.batchers
        return JSONResponse({"status": "ok", "model": self.served.name, "op": self.served.op,
                             "queue": batcher.router.best() if batcher.router
                             else self.served.queues[0],
                             "routes": batcher.router.to_json() if batcher.router else {},
                             "pending": sum(b.pending for b in batchers),
                             # how answers are found: notices of stored states, or polls
                             "results": "notified" if batcher.watch else "polled",
                             "notices": batcher.watch.heard if batcher.watch else 0,
                             # answers and stream pieces taken from a notice (no GET)
                             "from_notices": sum(b.from_notices for b in batchers)})

    async def metrics(self, request: Request) -> Response:
        from starlette.responses import Response

        if not self.authorised(request):
            return self.error(401, UNAUTHORISED)
        metrics = self.batcher.metrics
        if metrics is None:
            return self.error(501, "metrics need prometheus-client: pip install "
                                   "'fedq[metrics]'")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        metrics.pending.set(sum(b.pending for b in self.batchers))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- running ---------------------------------------------------------------------------

    def read_keys(self) -> None:
        """Read the API keys again (the database away: the last ones are kept)."""
        served = self.served
        if served.read_key_table is None:
            return
        try:
            served.key_table = served.read_key_table()
        except Exception as exc:  # noqa: BLE001 - the database away: keep the last
            log.warning("fedq serve: could not read the API keys: %s", exc)

    def refresh(self) -> None:
        """Forever, in a thread of its own: every ``ROUTE_EVERY_S`` the routes (the live
        workers of each queue, shared by every batcher), every ``KEYS_EVERY_S`` the API
        keys."""
        last = 0.0
        while True:
            if time.monotonic() - last >= ROUTE_EVERY_S:
                last = time.monotonic()
                self.batcher.reroute()
                for other in self.batchers[1:]:
                    assert other.router is not None and self.batcher.router is not None
                    other.router.live = dict(self.batcher.router.live)
                    other.router.slots = dict(self.batcher.router.slots)
            self.read_keys()
            time.sleep(KEYS_EVERY_S)

    @contextlib.asynccontextmanager
    async def lifespan(self, application: Any) -> AsyncIterator[None]:
        """The batchers and the result notices run while the application does; the API
        keys are read before the first request (closed until then)."""
        loop = asyncio.get_running_loop()
        collectors = [loop.create_task(b.run()) for b in self.batchers]
        watch = result_watch(str(app.conf.result_backend or "").split("+", 1)[-1])
        if watch is not None:
            try:
                await watch.start()
            except Exception as exc:  # noqa: BLE001 - polling works without it
                log.warning("fedq serve: no result notices (%s); polling", exc)
                await watch.close()
                watch = None
        if watch is not None:
            collectors.append(loop.create_task(watch.listen()))
            for b in self.batchers:
                b.watch = watch
        served = self.served
        if served.read_key_table is not None and served.key_table is None:
            from fedq.serve.keys import Keys

            served.key_table = Keys(True, frozenset())  # closed until the table is read
        await asyncio.to_thread(self.read_keys)  # before the first request
        threading.Thread(target=self.refresh, name="fedq-serve-route", daemon=True).start()
        yield
        for collector in collectors:
            collector.cancel()
        if watch is not None:
            await watch.close()


def build_app(served: Served) -> Any:
    """The Starlette application of a :class:`Gateway` for ``served``."""
    return Gateway(served).app


def prepare(settings: Any, src: Any, base: Any, queues: list[str], **options: Any) -> Served:
    """What to serve: the model of ``src`` (a ModelSource) checked to build, its weights
    in the blob store where the workers read them. With FEDQ_IDENTITY=required,
    ``options`` carries ``read_registry`` (the caller's reader of the registered
    workers), and the batches are sealed with the coordinator's keys."""
    import torch

    from fedq.blobs import store_for
    from fedq.data import shape_of
    from fedq.db.session import ensure_schema
    from fedq.engine.broker import check_broker
    from fedq.errors import FedqError, SpecError
    from fedq.inference.jobs import model_source
    from fedq.inference.run import load_model
    from fedq.protocol.inference import model_key
    from fedq.weights import loads

    check_broker()
    store = store_for(settings)
    store.check()
    # its API keys live in the database, as a job's model does: the embedded default is
    # migrated here (another database names `fedq db upgrade` in one line)
    ensure_schema(settings.database_url)
    arch, blob, data = model_source(settings, src, base)
    try:
        ds = shape_of(arch["dataset"], arch["dataset_args"])
    except FedqError as exc:
        raise SpecError(f"model.dataset: {exc}") from None
    if data is not None:
        try:
            load_model(arch, loads(data, what=str(src.weights)), torch.device("cpu"))
        except (FedqError, TypeError, ValueError, RuntimeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise SpecError(f"--weights: {src.weights} is not a {arch['name']} for "
                            f"{arch['dataset']}: {first[:300]}") from None
        blob = store.put(model_key(f"serve-{uuid.uuid4().hex[:12]}"), data)
    assert blob is not None
    name = src.job if src.job not in (None, "latest") else \
        (blob.key.split("/")[1] if src.job == "latest" else str(src.weights or src.hf))
    if settings.identity == "required":
        if options.get("read_registry") is None:
            raise FedqError("FEDQ_IDENTITY=required: fedq serve needs the registered "
                            "workers (run it where the coordinator's database is)")
        identity.coordinator_key(settings.keys_dir)  # its keys: made, or a clear error
        options = {**options, "keys": settings.keys_dir,
                   "registry": options["read_registry"]()}
    else:
        options = {**options, "read_registry": None}
    from fedq.inference.jobs import embedding_width

    try:
        width = embedding_width(arch) if ds.is_text else None
    except SpecError:  # a language model without embeddings: no /v1/embeddings
        width = None
    text: dict[str, Any] = {}
    if ds.is_text and ds.tokenizer is not None and ds.tokenizer.name != "bytes":
        from fedq.data.tokens import chat_asker

        text = {"tokenizer": ds.tokenizer, "token_chars": ds.tokenizer.token_chars()}
        try:  # a tokenizer with a chat template: /v1/chat/completions
            text["chat"], text["chat_end"] = chat_asker(ds.tokenizer.name)
        except FedqError:
            pass
    return Served(name=str(name), op="generate" if ds.is_text else "classify",
                  model=blob.to_json(), arch=arch, classes=ds.num_classes, width=width,
                  input_shape=tuple(ds.input_shape), queues=queues, **text, **options)


def http_stack() -> tuple[str, str]:
    """(HTTP parser, event loop) the gateway runs on: httptools and uvloop, which
    ``uvicorn[standard]`` installs, where they import here; h11 and asyncio otherwise
    (uvloop has no Windows build)."""
    from importlib.util import find_spec

    return ("httptools" if find_spec("httptools") else "h11",
            "uvloop" if find_spec("uvloop") else "asyncio")


def run(served: Served, host: str, port: int) -> None:
    import uvicorn

    # No task-sent event per batch: a second publish on each request's path. The
    # dashboard would list every batch; the gateway's /metrics counts them instead.
    app.conf.task_send_sent_event = False
    http, loop = http_stack()
    uvicorn.run(build_app(served), host=host, port=port, log_level="warning", http=http,
                loop=loop)
