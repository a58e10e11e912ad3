"""Reading a request body within bounds: a size limit enforced while reading, a read
timeout for slow bodies, a nesting bound on its JSON (413 / 408 / 400)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fedq.serve.served import MAX_JSON_DEPTH


class BadBody(Exception):
    """A request body refused before it is parsed: too large (413), too slow (408), or
    not JSON within :data:`MAX_JSON_DEPTH` (400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_json(request: Any, limit: int, timeout_s: float) -> Any:
    """A request's body parsed as JSON, read no further than ``limit`` bytes (a
    ``Content-Length`` over it is refused unread) and within ``timeout_s`` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadBody(413, f"the request body is {int(declared)} bytes, more than the "
                           f"{limit} a request may have")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadBody(413, f"the request body is more than the {limit} bytes a "
                                   f"request may have")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        data = await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise BadBody(408, f"the request body did not arrive within {timeout_s:g} s") from None
    try:
        body = json.loads(data)
    except RecursionError:
        raise BadBody(400, f"the request's JSON nests deeper than {MAX_JSON_DEPTH}") from None
    except ValueError as exc:
        raise BadBody(400, f"the request body is not JSON: {str(exc)[:100]}") from None
    if _depth_over(body, MAX_JSON_DEPTH):
        raise BadBody(400, f"the request's JSON nests deeper than {MAX_JSON_DEPTH}")
    return body


def _depth_over(value: Any, bound: int) -> bool:
    """Whether ``value`` (parsed JSON) nests deeper than ``bound`` (no recursion)."""
    level: list[Any] = [value] if isinstance(value, (list, dict)) else []
    for _ in range(bound):  # level: the containers at depth 1, 2, ...
        level = [v for x in level if isinstance(x, (list, dict))
                 for v in (x.values() if isinstance(x, dict) else x)
                 if isinstance(v, (list, dict))]
    return bool(level)
