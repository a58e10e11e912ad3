"""Keeping credentials out of text: every URL fedq puts into an error, a log line, a
database row, a task result or CLI output goes through :func:`redact` first.

A URL's password is its userinfo after the first ``:`` (up to the *last* ``@`` of
the authority: a password may contain ``@``), and any query parameter whose name says
it is a secret (``?password=...``). :func:`redact_text` finds the URLs inside free
text (an exception's message, a log line) and redacts each; :func:`scrub` also
replaces the literal secrets this process was configured with (``remember``), which
catches a password that an upstream library printed without its URL.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote

MASK = "***"

# Query parameters that carry a secret (lower case), in the URL forms fedq reads.
_SECRET_PARAMS = ("password", "passwd", "pass", "pwd", "secret", "token", "access_token",
                  "secret_key", "aws_secret_access_key", "ssl_password", "sslpassword",
                  "x-amz-signature", "x-amz-credential", "x-amz-security-token", "signature")

# scheme://[userinfo@]host... up to whitespace or a character that ends a URL in prose
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")

_remembered: set[str] = set()


def redact(url: str) -> str:
    """``url`` with its password and secret query parameters replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # The authority ends at the first '/', '?' or '#' after the last '@' (a password
    # may contain '@' and, written raw, even '/': the last '@' before the query wins).
    query_at = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, query_at)
    if at >= 0:
        userinfo, tail = rest[:at], rest[at:]
        user, colon, _ = userinfo.partition(":")
        rest = (f"{user}:{MASK}" if colon else (MASK if _looks_like_token(user) else user)) \
            + tail
    base, q, query = rest.partition("?")
    if q:
        query = "&".join(_redact_param(p) for p in query.split("&"))
    return f"{scheme}://{base}{q}{query}"


def _looks_like_token(user: str) -> bool:
    """A userinfo with no ``:`` is a user name, except a long opaque one (a token)."""
    return len(user) >= 32


def _redact_param(param: str) -> str:
    name, eq, _ = param.partition("=")
    return f"{name}={MASK}" if eq and name.lower() in _SECRET_PARAMS else param


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted and every remembered secret masked."""
    out = _URL.sub(lambda m: redact(m.group(0)), text)
    for secret in sorted(_remembered, key=len, reverse=True):
        if secret in out:
            out = out.replace(secret, MASK)
    return out


def secrets_of(url: str) -> list[str]:
    """The secrets inside ``url``: its password (as written and decoded) and the values
    of its secret query parameters."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return []
    found: list[str] = []
    query_at = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, query_at)
    if at >= 0:
        _, colon, password = rest[:at].partition(":")
        if colon and password:
            found += [password, unquote(password)]
    _, q, query = rest.partition("?")
    if q:
        found += [v for k, v in parse_qsl(query, keep_blank_values=False)
                  if k.lower() in _SECRET_PARAMS and v]
    return [s for s in found if len(s) >= 4]  # shorter ones would mask ordinary words


def remember(values: Iterable[str | None]) -> None:
    """Mask these secrets (and those inside these URLs) wherever :func:`redact_text`
    runs in this process."""
    for value in values:
        if not value:
            continue
        found = secrets_of(value)
        if found:
            _remembered.update(found)
        elif "://" not in value and len(value) >= 8:  # a bare secret (a key, a password)
            _remembered.add(value)


class RedactingFilter(logging.Filter):
    """A log filter that redacts the formatted message (and any exception text) of
    every record before a handler writes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string is logging's own problem
            return True
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = redact_text(text)
            record.exc_info = None
        return True


def install_log_filter(logger: logging.Logger | None = None) -> None:
    """Redact every record that reaches ``logger``'s handlers (the root logger's by
    default), once per handler."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
