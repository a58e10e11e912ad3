"""``fedq serve``: an HTTP gateway (Starlette on uvicorn) in front of the workers.

Its parts: :mod:`~fedq.serve.served` (what is served, its bounds),
:mod:`~fedq.serve.bounds` (reading a request), :mod:`~fedq.serve.openai` (the API's
requests and answers), :mod:`~fedq.serve.batcher` and :mod:`~fedq.serve.router`
(batches and where they go), :mod:`~fedq.serve.results` (answers checked),
:mod:`~fedq.serve.keys` (API keys), :mod:`~fedq.serve.app` (the application).

Requests are collected into batches (at most ``max_batch`` items, or whatever has come
within ``max_wait_ms`` of a batch's first item, as Ray Serve's ``@serve.batch``; with
no batch out, a batch goes at once with what is queued: nothing to wait for); each
batch is one ``fedq.serve_batch`` task on a hardware queue, to a worker that keeps the
model loaded; its answer comes back through the result backend and is checked like a
shard's (fedq/protocol/inference.py) before any of it is returned. While every live
worker holds a batch, the next one keeps growing until a batch comes back, it is full,
or it has waited twice the quickest queue's round trip (``Batcher.hold_s``): sent at
once it would only wait in the broker, as a small batch that costs a worker nearly
what a full one does.

- Routing: the fastest class with a live worker among the queues given
  (gpu_new, then gpu_sm61, then cpu), looked up again every ``ROUTE_EVERY_S``.
- Back-pressure: past ``max_queue`` items waiting or out, a request is answered 503
  with ``Retry-After``; the gateway never holds more.
- A lost batch (no answer within ``batch_timeout_s``, or a refused one) is sent once
  more; then its requests get 504 (no answer) or 502 (a refused answer).
- ``FEDQ_SERVE_API_KEY`` set: every request but ``/health`` needs
  ``Authorization: Bearer KEY`` (compared in constant time).
- ``"stream": true`` on a completion: server-sent events as OpenAI's API sends them.
  A batch with a streamed request says so (``stream`` in its message), and its worker
  writes each item's text so far into the batch task's state (``STREAMING``, at most
  every 50 ms; a batch without one gets only the answer); the gateway, which polls
  that state anyway, checks it (a list of strings, no longer than the items'
  ``max_tokens``) and sends what was added. The final answer is checked as a
  non-streamed one is; if it does not continue what was streamed, the stream ends
  with an error event; with ``stream_options: {"include_usage": true}`` a last chunk
  carries the request's usage. Streamed pieces are
  signed too (with identity required, a piece not signed for its task by a registered
  worker is dropped, as an unsigned answer is refused).
- A batch's stored state is read only up to :func:`answer_bytes` (its items times the
  longest output line their op may have, plus room for the signature): a longer one
  is a refused answer, not read from the key and not decoded from its notice.
"""
