"""What ``fedq serve`` serves (:class:`Served`), the bounds of what it reads and
answers, and :class:`Refused`, the error a request gets for a batch that failed."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from fedq.protocol.inference import line_bytes

log = logging.getLogger(__name__)


ROUTE_EVERY_S = 15.0


KEYS_EVERY_S = 3.0


MAX_ITEMS_PER_REQUEST = 256


MAX_PROMPT_BYTES = 16_384


SEND_GRACE_S = 2.0  # beyond batch_timeout_s, for a batch's send and its revocation


DECODE_INLINE_BYTES = 65_536  # a published state up to this size is decoded in the loop


#: Room in a batch's stored state beside its output lines: Celery's envelope, the
#: worker's name and time, a signature (about 200 bytes), JSON's keys between lines.
ANSWER_ROOM_BYTES = 16_384


READ_TIMEOUT_S = 10.0  # a request body not whole by then: 408


#: How deep a request's JSON may nest (the deepest legal one, a batch of images, is
#: the image's dimensions plus two).
MAX_JSON_DEPTH = 16


#: The most characters one number or one prompt byte takes in a legal request's JSON
#: (a float's repr with its separator; a control byte escaped as \u00XX).
NUMBER_CHARS = 32


ESCAPE_CHARS = 6


BODY_ROOM_BYTES = 65_536  # a request's keys, options and whitespace


def body_bound(served: Served) -> int:
    """The largest legal request body for ``served``: :data:`MAX_ITEMS_PER_REQUEST`
    inputs of the model's shape (classifiers) or prompts of :data:`MAX_PROMPT_BYTES`
    (language models), each at its longest in JSON."""
    if served.op == "classify":
        item = math.prod(served.input_shape) * NUMBER_CHARS
    else:
        item = MAX_PROMPT_BYTES * ESCAPE_CHARS
    return MAX_ITEMS_PER_REQUEST * item + BODY_ROOM_BYTES


def answer_bytes(op: str, n: int, max_tokens: int = 0, token_chars: int = 1) -> int:
    """The most bytes the stored state of a batch of ``n`` items for ``op`` may have:
    each output is one of a shard's lines (:func:`line_bytes` for texts of up to
    ``max_tokens`` tokens of ``token_chars`` characters), which a streamed piece (no
    longer than the text) is within too."""
    return n * (line_bytes(op, max_tokens, token_chars) + 64) + ANSWER_ROOM_BYTES


class Refused(Exception):
    """A batch's answer that did not check out (status 502), or none came (504)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Served:
    """What is served: the model's blob and shape, and how to batch and route."""

    name: str
    op: str  # classify | generate
    model: dict[str, Any]  # blob ref
    arch: dict[str, Any]
    classes: int
    input_shape: tuple[int, ...]
    queues: list[str]
    width: int | None = None  # a language model's embedding width (/v1/embeddings)
    # a language model's tokenizer (fedq.data.tokens; None: bytes), the most characters
    # one of its tokens decodes to, and its chat template (/v1/chat/completions): a
    # conversation to the text that asks for the next reply, and the text ending a reply
    tokenizer: Any = None
    token_chars: int = 1
    chat: Any = None
    chat_end: str | None = None
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_queue: int = 1024
    batch_timeout_s: float = 30.0
    api_key: str | None = None
    max_tokens: int = 256
    # FEDQ_IDENTITY=required: the coordinator's keys folder (batches are sealed with
    # them) and a reader of the registered workers (answers must be signed by one),
    # called again every ROUTE_EVERY_S so that a revocation holds
    keys: Any = None
    read_registry: Any = None
    registry: Any = None
    # API keys one per person (fedq/serve/keys.py): a reader of the table, read at
    # start and every KEYS_EVERY_S, and what it last read
    read_key_table: Any = None
    key_table: Any = None
    # what a request body may be: bytes at most (None: :func:`body_bound`, the largest
    # legal request), seconds to arrive whole
    max_body: int | None = None
    read_timeout_s: float = READ_TIMEOUT_S

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` is to the served model (bytes without a tokenizer)."""
        if self.tokenizer is None:
            return len(text.encode())
        return len(self.tokenizer.encode(text))

    @property
    def body_limit(self) -> int:
        return self.max_body if self.max_body is not None else body_bound(self)
