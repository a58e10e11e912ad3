"""A registered worker's own RabbitMQ user: what Celery's consumer needs on a training
worker, and nothing else (docs/security.md, "Least privilege"). The RabbitMQ side of
fedq/coordinator/acl.py, made through RabbitMQ's management API.

RabbitMQ grants per virtual host three regular expressions over resource names:
*configure* (declare, delete), *write* (publish to an exchange; bind a queue) and
*read* (consume a queue; bind from an exchange). A worker's user may:

- declare, bind and consume its own queues (``cpu``) and nothing else: not another
  class's queue, not the ``control`` queue;
- send tasks to the control queue through its exchange, ``fedq.control``
  (fedq/engine/names.py), which it does not declare: a right to publish there is not a
  right to read the queue, which keeps its own name (the reason the exchange has
  another one);
- never publish through RabbitMQ's default exchange, which reaches every queue by name
  (another class's tasks, the control worker's remote-control queue);
- listen for remote-control commands on its own queue (kombu makes it exclusive: no
  other connection consumes it) and answer them, and send task events (the
  dashboard), but never publish to ``celery.pidbox`` (no ``shutdown`` of the control
  worker, no ``revoke``, no ``cancel_consumer``).

Results and blobs are not RabbitMQ's: a worker's Redis user covers them
(fedq/coordinator/acl.py). tests/test_acl.py trains a job under these rules and tries
each refusal.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterable
from urllib.parse import quote, unquote, urlsplit

from fedq.coordinator.acl import username
from fedq.engine.names import CONTROL_EXCHANGE
from fedq.errors import ConfigError, ServiceUnavailable

log = logging.getLogger(__name__)

#: RabbitMQ's management API listens here unless FEDQ_RABBITMQ_API says otherwise
API_PORT, API_TLS_PORT = 15672, 15671
#: a node's remote-control queue (``celery@host.celery.pidbox``) and a caller's reply
#: queue (``<id>.reply.celery.pidbox``); never the exchange ``celery.pidbox`` itself
_MAILBOXES = r".+\.celery\.pidbox"


def is_amqp(url: str | None) -> bool:
    return bool(url) and urlsplit(url or "").scheme in ("amqp", "amqps", "pyamqp")


def permissions(queues: Iterable[str]) -> dict[str, str]:
    """The ``configure``, ``write`` and ``read`` expressions of a worker consuming
    ``queues`` (RabbitMQ matches them unanchored: each is anchored here)."""
    own = [re.escape(q) for q in queues]

    def anchored(*names: str) -> str:
        return "^(?:" + "|".join(names) + ")$"

    return {
        # its queues and their exchanges; the events exchange; its mailbox and the
        # exchanges kombu declares before it listens and answers
        "configure": anchored(*own, "celeryev", r"celery\.pidbox", r"reply\.celery\.pidbox",
                              _MAILBOXES),
        # bind its queues and mailbox; publish to the control exchange, events, answers
        "write": anchored(*own, re.escape(CONTROL_EXCHANGE), "celeryev",
                          r"reply\.celery\.pidbox", _MAILBOXES),
        # consume its queues and mailbox; bind its mailbox to the commands' exchange
        "read": anchored(*own, r"celery\.pidbox", _MAILBOXES),
    }


def vhost(broker_url: str) -> str:
    """The virtual host ``broker_url`` names (kombu's reading: ``amqp://h//`` and
    ``amqp://h`` are ``/``)."""
    path = urlsplit(broker_url).path
    name = unquote(path[1:]) if path.startswith("/") else ""
    return name or "/"


def api_url(broker_url: str, override: str | None = None) -> str:
    """The management API's base URL: ``override`` (FEDQ_RABBITMQ_API), else the
    broker's host on 15672 (15671 for amqps) with the broker's credentials."""
    if override:
        return override.rstrip("/")
    parts = urlsplit(broker_url)
    tls = parts.scheme == "amqps"
    auth = ""
    if parts.username:
        auth = f"{parts.username}:{parts.password or ''}@"
    return (f"{'https' if tls else 'http'}://{auth}{parts.hostname or 'localhost'}:"
            f"{API_TLS_PORT if tls else API_PORT}")


def _call(api: str, method: str, path: str, body: object | None = None) -> object:
    """One management API request; its JSON answer (None for an empty one). Raises
    FileNotFoundError for a 404, ConfigError when refused, ServiceUnavailable when
    the API does not answer."""
    parts = urlsplit(api)
    base = f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    request = urllib.request.Request(base + parts.path.rstrip("/") + path, method=method,
                                     data=None if body is None else json.dumps(body).encode())
    request.add_header("content-type", "application/json")
    if parts.username:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        request.add_header("authorization", "Basic " + base64.b64encode(pair.encode()).decode())
    context = ssl.create_default_context() if parts.scheme == "https" else None
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise FileNotFoundError(path) from None
        raise ConfigError(f"RabbitMQ's management API refused {method} {path.split('?')[0]} "
                          f"(HTTP {exc.code}); the coordinator's broker user must be an "
                          f"administrator, or set FEDQ_RABBITMQ_API") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ServiceUnavailable(f"cannot reach RabbitMQ's management API at {base} "
                                 f"({getattr(exc, 'reason', exc)}; enable it with "
                                 f"`rabbitmq-plugins enable rabbitmq_management`, or set "
                                 f"FEDQ_RABBITMQ_API)") from None
    return json.loads(raw) if raw.strip() else None


def create_user(broker_url: str, name: str, queues: Iterable[str], password: str,
                api: str | None = None) -> None:
    """Create (or reset) worker ``name``'s RabbitMQ user, with only its permissions on
    the broker's virtual host."""
    base, user = api_url(broker_url, api), quote(username(name), safe="")
    _call(base, "PUT", f"/api/users/{user}", {"password": password, "tags": ""})
    _call(base, "PUT", f"/api/permissions/{quote(vhost(broker_url), safe='')}/{user}",
          permissions(queues))


def disable_user(broker_url: str, name: str, api: str | None = None) -> bool:
    """Delete worker ``name``'s RabbitMQ user and close its connections; False when it
    had none."""
    base = api_url(broker_url, api)
    try:
        _call(base, "DELETE", f"/api/users/{quote(username(name), safe='')}")
        found = True
    except FileNotFoundError:
        found = False
    except (ConfigError, ServiceUnavailable) as exc:
        log.warning("could not delete the RabbitMQ user %s: %s", username(name), exc)
        return False
    try:
        listed = _call(base, "GET", "/api/connections?columns=name,user")
        for conn in listed if isinstance(listed, list) else []:
            if conn.get("user") == username(name):
                _call(base, "DELETE", f"/api/connections/{quote(conn['name'], safe='')}")
    except (FileNotFoundError, ConfigError, ServiceUnavailable) as exc:
        log.warning("could not close %s's connections: %s", username(name), exc)
    return found


def user_exists(broker_url: str, name: str, api: str | None = None) -> bool:
    try:
        _call(api_url(broker_url, api), "GET", f"/api/users/{quote(username(name), safe='')}")
        return True
    except FileNotFoundError:
        return False
