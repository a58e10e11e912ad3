"""A worker, started as users start one (``celery -A fedq worker -Q cpu``, none of the
test harness's flags), rides out a broker that goes away and comes back: one line
when the connection is lost, one per retry, one when it is back, and no traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedq.testing.wait import wait_until
from tests.conftest import private_redis

pytestmark = pytest.mark.slow


def test_worker_reconnects_to_a_restarted_broker_without_a_traceback(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with private_redis() as (url, restart):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
        env.update(FEDQ_HOME=str(tmp_path / "home"), FEDQ_BROKER_URL=url,
                   FEDQ_RESULT_BACKEND=url[:-1] + "1")
        with open(log, "wb") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "fedq", "worker", "-Q", "cpu",
                 "-c", "1", "-n", "reconnect@%h", "-l", "INFO"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_until(lambda: b"reconnect@" in log.read_bytes()
                       and b"ready." in log.read_bytes(), 120, interval=0.5,
                       what=lambda: f"the worker to start:\n{log.read_text()[-3000:]}")
            # Refused-then-reset, as behind Docker's port proxy: this is what made
            # Gossip's restart fail inside kombu (fedq/engine/consumer.py)
            restart(proxy_s=6)
            wait_until(lambda: len(re.findall("Connected to redis", log.read_text())) >= 2,
                       120, interval=0.5,
                       what=lambda: f"the worker to reconnect:\n{log.read_text()[-3000:]}")
        finally:
            worker.terminate()
            worker.wait(30)
    text = log.read_text()
    after = text[text.index("ready."):]
    assert after.count("Connection to broker lost") == 1, after
    assert "Traceback" not in after and "Error on restarting" not in after, after
    assert "CPendingDeprecationWarning" not in after, after


def test_the_worker_consumer_has_no_gossip() -> None:
    """What the test above relies on, checked without timing: the consumer
    ``celery -A fedq worker`` builds is fedq's, without Gossip."""
    from celery.utils.imports import symbol_by_name

    from fedq.engine.app import app
    from fedq.engine.consumer import GOSSIP

    consumer = symbol_by_name(app.conf.worker_consumer)
    steps = consumer.Blueprint.default_steps
    assert GOSSIP not in steps and "celery.worker.consumer.tasks:Tasks" in steps
    assert app.conf.worker_cancel_long_running_tasks_on_connection_loss is False
