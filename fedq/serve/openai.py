"""The requests and answers of the HTTP API, shaped as OpenAI's (completions, chat
completions, embeddings, errors) and fedq's own ``/v1/predict``: each request parsed into batch
items, and each answer shaped back."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from fedq.serve.served import MAX_ITEMS_PER_REQUEST, MAX_PROMPT_BYTES, Served

#: OpenAI's error ``type`` for each HTTP status fedq answers with (its API reference's
#: error codes); anything else 5xx is a ``server_error``.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error",
               413: "invalid_request_error", 415: "invalid_request_error",
               429: "rate_limit_error"}


def error_object(status: int, message: str) -> dict[str, Any]:
    """An error as OpenAI's API answers one: ``{"error": {"message", "type", "param",
    "code"}}``; the HTTP status is the response's (``code`` is None: fedq has no
    finer error codes)."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _flat(value: Any, out: list[float]) -> None:
    if isinstance(value, list):
        for v in value:
            _flat(v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value):
        out.append(float(value))
    else:
        raise ValueError(f"{str(value)[:40]!r} is not a finite number")


def parse_predict(body: Any, served: Served) -> list[list[float]]:
    """``{"inputs": [image, ...]}``, each image nested or flat, ``input_shape`` numbers."""
    size = math.prod(served.input_shape)
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or \
            set(body) != {"inputs"}:
        raise ValueError('expected {"inputs": [image, ...]}')
    images = body["inputs"]
    if not 0 < len(images) <= MAX_ITEMS_PER_REQUEST:
        raise ValueError(f"inputs: 1 to {MAX_ITEMS_PER_REQUEST} images")
    out = []
    for n, image in enumerate(images):
        flat: list[float] = []
        _flat(image, flat)
        if len(flat) != size:
            raise ValueError(f"inputs[{n}]: {len(flat)} numbers, the model takes {size} "
                             f"(shape {list(served.input_shape)})")
        out.append(flat)
    return out


#: The fields of OpenAI's completions request fedq takes (``user`` names the end user
#: and changes nothing); any other (``echo``, ``logprobs``, ``top_p``, ...) is refused
#: by name.
COMPLETION_FIELDS = ("prompt", "max_tokens", "temperature", "top_k", "seed", "model",
                     "stream", "stream_options", "n", "stop", "user")


MAX_N = 16


MAX_STOPS = 4  # OpenAI's bound on stop sequences


def parse_completion(body: Any, served: Served) -> list[dict[str, Any]]:
    """An OpenAI-style completion request: ``prompt`` (a string or a list of them),
    max_tokens, temperature, top_k, seed, ``n`` completions of each prompt (item k of a
    prompt samples with seed + k) and ``stream`` (read by the endpoint: not part of an
    item); ``stop`` is applied to the answers (:func:`parse_stops`). One item per
    prompt and completion, prompt by prompt."""
    if not isinstance(body, dict) or "prompt" not in body:
        raise ValueError('expected an object with a "prompt": a string or a list of strings')
    _check_fields(body, COMPLETION_FIELDS)
    if not isinstance(body.get("stream", False), bool):
        raise ValueError("stream: true or false")
    include_usage(body)
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ValueError(f"n: an integer in 1..{MAX_N}")
    if not prompts or len(prompts) * n > MAX_ITEMS_PER_REQUEST:
        raise ValueError(f"prompt: 1 or more strings, times n at most {MAX_ITEMS_PER_REQUEST}")
    for k, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise ValueError(f"prompt[{k}]: not a string")
        if len(prompt.encode()) > MAX_PROMPT_BYTES:
            raise ValueError(f"prompt[{k}]: more than {MAX_PROMPT_BYTES} bytes")
    parse_stops(body)
    if body.get("stream") is True and len(prompts) * n > 1:
        raise ValueError("stream: one prompt and n 1")
    base = {"max_tokens": body.get("max_tokens", 16), "temperature": body.get("temperature", 1.0),
            "top_k": body.get("top_k", 0), "seed": body.get("seed", 0)}
    for key, lo, hi in (("max_tokens", 1, served.max_tokens), ("top_k", 0, 1_000_000),
                        ("seed", 0, 2**31 - n)):
        value = base[key]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"{key}: an integer in {lo}..{hi}")
    temp = base["temperature"]
    if not isinstance(temp, (int, float)) or isinstance(temp, bool) or not 0 < temp <= 10:
        raise ValueError("temperature: a number in (0, 10]")
    base["temperature"] = float(temp)
    return [{"prompt": prompt, **base, "seed": base["seed"] + k}
            for prompt in prompts for k in range(n)]


#: The fields of OpenAI's chat completions request fedq takes; any other (``tools``,
#: ``logprobs``, ``response_format``, ...) is refused by name.
CHAT_FIELDS = ("messages", "max_tokens", "max_completion_tokens", "temperature", "top_k",
               "seed", "model", "stream", "stream_options", "n", "stop", "user")


#: The roles a chat message may have.
CHAT_ROLES = ("system", "developer", "user", "assistant")


MAX_MESSAGES = 256


def parse_chat(body: Any, served: Served) -> tuple[list[dict[str, Any]], str, list[str]]:
    """An OpenAI-style chat completion request: ``messages`` (each ``{role, content}``
    with a string content), rendered by the served model's chat template into the text
    that asks for the next assistant turn, then read as a completion of that text
    (:func:`parse_completion`: ``max_tokens``, or ``max_completion_tokens`` as OpenAI's
    newer name for it, temperature, top_k, seed, n, stream). The batch items, the
    rendered prompt, and the stops: the request's, then the text that ends a reply."""
    if not isinstance(body, dict) or "messages" not in body:
        raise ValueError('expected an object with "messages": [{"role", "content"}, ...]')
    _check_fields(body, CHAT_FIELDS)
    messages = body["messages"]
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise ValueError(f"messages: a list of 1 to {MAX_MESSAGES} messages")
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise ValueError(f"messages[{k}]: an object of role and content")
        if message.get("role") not in CHAT_ROLES:
            raise ValueError(f"messages[{k}].role: one of {', '.join(CHAT_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{k}].content: a string (content parts are not "
                             "supported by fedq serve)")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise ValueError("max_tokens, max_completion_tokens: give one")
    try:
        prompt = served.chat([{"role": m["role"], "content": m["content"]}
                              for m in messages])
    except ValueError as exc:
        raise ValueError(f"messages: {exc}") from None
    if len(prompt.encode()) > MAX_PROMPT_BYTES:
        raise ValueError(f"messages: more than {MAX_PROMPT_BYTES} bytes once rendered")
    asked = {k: v for k, v in body.items()
             if k in COMPLETION_FIELDS and k not in ("messages", "max_completion_tokens")}
    if "max_completion_tokens" in body:
        asked["max_tokens"] = body["max_completion_tokens"]
    items = parse_completion({**asked, "prompt": prompt}, served)
    stops = parse_stops(body) + ([served.chat_end] if served.chat_end else [])
    return items, prompt, stops


def include_usage(body: dict[str, Any]) -> bool:
    """A completion request's ``stream_options``: ``{"include_usage": true|false}``,
    with ``stream: true`` only (as OpenAI's API takes it); whether the stream ends with
    a usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if body.get("stream") is not True:
        raise ValueError("stream_options: only with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise ValueError('stream_options: {"include_usage": true or false}')
    return bool(options.get("include_usage", False))


def _check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """Refuse, by name, a field of OpenAI's request that fedq does not take (never
    ignored in silence); ``user`` (the end user's name) must be a string."""
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not supported by fedq serve (fields: "
                         f"{', '.join(allowed)})")
    if "user" in body and not isinstance(body["user"], str):
        raise ValueError("user: a string")


def parse_stops(body: dict[str, Any]) -> list[str]:
    """A completion request's ``stop``: a string or up to :data:`MAX_STOPS` of them."""
    stop = body.get("stop")
    if stop is None:
        return []
    stops = stop if isinstance(stop, list) else [stop]
    if len(stops) > MAX_STOPS or not all(isinstance(x, str) and 0 < len(x) <= 256
                                         for x in stops):
        raise ValueError(f"stop: a string or a list of at most {MAX_STOPS} non-empty strings")
    return stops


def stopped(text: str, stops: Sequence[str]) -> tuple[str, str]:
    """``text`` cut before the first of ``stops`` in it, and its finish reason (``stop``
    where one was found, else ``length``)."""
    cut = min((i for i in (text.find(x) for x in stops) if i >= 0), default=-1)
    return (text[:cut], "stop") if cut >= 0 else (text, "length")


#: The fields of OpenAI's embeddings request fedq takes (``user`` names the end user
#: and changes nothing); any other is refused by name.
EMBEDDING_FIELDS = ("input", "model", "encoding_format", "user")


def parse_embeddings(body: Any, served: Served) -> list[str]:
    """An OpenAI-style embeddings request: ``input``, a string or a list of strings;
    ``encoding_format`` float (the default) or base64 (:func:`embedding_out` reads it
    from the request again)."""
    if not isinstance(body, dict) or "input" not in body:
        raise ValueError('expected {"input": "text" or ["text", ...]}')
    _check_fields(body, EMBEDDING_FIELDS)
    if body.get("encoding_format", "float") not in ("float", "base64"):
        raise ValueError("encoding_format: float or base64")
    texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
    if not 0 < len(texts) <= MAX_ITEMS_PER_REQUEST:
        raise ValueError(f"input: 1 to {MAX_ITEMS_PER_REQUEST} strings")
    for n, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"input[{n}]: not a string")
        if len(text.encode()) > MAX_PROMPT_BYTES:
            raise ValueError(f"input[{n}]: more than {MAX_PROMPT_BYTES} bytes")
    return texts


def usage(prompts: list[str], texts: list[str],
          count: Callable[[str], int] | None = None) -> dict[str, int]:
    """OpenAI's ``usage`` of a completion request (each prompt counted once, every
    choice's text), in tokens as ``count`` counts a text's (the served model's
    tokenizer; bytes when None)."""
    count = count or (lambda text: len(text.encode()))
    n = sum(map(count, prompts))
    m = sum(map(count, texts))
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def embedding_out(vector: list[float], encoding: str) -> list[float] | str:
    """One embedding as OpenAI's API returns it: a list of floats, or with
    ``encoding_format: base64`` the base64 of its little-endian float32 values."""
    if encoding != "base64":
        return vector
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
