"""`docker compose up` on a real Docker engine, as docs/deploy.md tells a user to run it.

The coordinator stack of docker/compose.yaml (with docker/compose.debian.yaml: this host
reaches no registry, so Redis, PostgreSQL and SeaweedFS come from images built from
Debian packages by scripts/images.sh), worker containers on the cpu queue joining over
the published ports as another machine would, and jobs submitted with the fedq CLI from
the host. Faults: a worker container killed mid-round, `docker compose restart control`
mid-job, and `docker compose down` / `up` with the volumes kept.

A stage of its own (`bash scripts/test-deploy.sh`, marker `docker`); with CI=true a
missing engine or image fails."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from fedq.db import WatchdogAction, session_scope
from fedq.db.models import aware
from fedq.testing.cluster import DIGITS, Cluster
from fedq.testing.wait import wait_until
from tests.conftest import free_port, missing

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ["fedq-coordinator", "fedq-worker:cpu", "fedq-redis", "fedq-postgres",
          "fedq-seaweedfs"]
# Each task trains for 2 s, so a kill lands mid-task; a stuck round is repaired after
# 15 s by the watchdog that beat runs. A gentle optimizer: 2 s is hundreds of steps on
# a small shard, and DIGITS' lr 0.05 with momentum 0.9 once diverged to a NaN loss
# there (a client's every attempt rejected, the job failed: CI, stop 38).
JOB = {**DIGITS, "num_clients": 4, "clients_per_round": 2, "min_clients": 2,
       "local_epochs": 1000, "time_budget_s": 2, "round_timeout_s": 15,
       "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.5},
       "max_redispatch": 3, "queues": {"cpu": -1}}


@dataclass
class Stack:
    docker: dict[str, str]  # the environment docker and docker-compose run with
    compose: list[str]
    project: str
    cli: Cluster  # the fedq CLI and database reads, from the host
    worker_env: Path
    home: Path
    ports: dict[str, int]
    flower_password: str
    passwords: list[str]

    def run(self, *args: str, check: bool = True, timeout: float = 300) -> str:
        proc = subprocess.run(list(args), env=self.docker, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc.stdout

    def compose_run(self, *args: str, timeout: float = 300) -> str:
        return self.run(*self.compose, *args, timeout=timeout)

    def up(self) -> None:
        """`up -d`, then wait for the control worker's healthcheck; the services' logs
        when either fails."""
        try:
            self.compose_run("up", "-d", "--no-build", timeout=600)
            self.wait_healthy("control")
        except AssertionError as exc:
            logs = self.run(*self.compose, "logs", "--tail", "25", check=False)
            raise AssertionError(f"{exc}\n--- logs\n{logs[-6000:]}") from None

    def container(self, service: str) -> str:
        return self.compose_run("ps", "-q", service).strip()

    def wait_healthy(self, service: str, timeout: float = 240) -> None:
        def healthy() -> bool:
            cid = self.container(service)
            return bool(cid) and self.run("docker", "inspect", "-f",
                                          "{{.State.Health.Status}}", cid,
                                          check=False).strip() == "healthy"

        wait_until(healthy, timeout, interval=2, what=lambda: (
            f"{service} to be healthy:\n"
            f"{self.compose_run('logs', '--tail', '40', service)}"))

    def start_worker(self, name: str, image: str = "fedq-worker:cpu") -> str:
        """A worker container on the cpu queue that reaches the coordinator over the
        published ports, as one on another machine would (host networking)."""
        container = f"{self.project}-{name}"
        mounts = [arg for name in ("broker_url", "result_backend", "s3_password")
                  for arg in ("-v", f"{self.worker_env.parent / name}:/run/secrets/{name}:ro")]
        self.run("docker", "run", "-d", "--name", container, "--network", "host",
                 "--env-file", str(self.worker_env), *mounts, image,
                 "celery", "-A", "fedq", "worker", "-Q", "cpu", "-c", "1",
                 "-n", f"{name}@%h", "-l", "INFO")
        wait_until(lambda: "ready." in self.logs(container), 120, interval=1,
                   what=lambda: f"{container} to be ready:\n{self.logs(container)[-3000:]}")
        return container

    def logs(self, container: str) -> str:
        proc = subprocess.run(["docker", "logs", container], env=self.docker,
                              capture_output=True, text=True, check=False)
        return proc.stdout + proc.stderr


def _write_secrets(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(mode=0o700)
    for name, value in files.items():
        (folder / name).write_text(value)
        (folder / name).chmod(0o644)  # read by each container's own user


def _docker_env() -> dict[str, str]:
    import os

    proc = subprocess.run(["bash", str(ROOT / "scripts" / "docker-engine.sh")],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        missing("Docker engine", proc.stderr.strip()[-500:])
    env = {**os.environ, "DOCKER_HOST": proc.stdout.strip()}
    for image in IMAGES:
        found = subprocess.run(["docker", "image", "inspect", image], env=env,
                               capture_output=True, check=False)
        if found.returncode != 0:
            missing(f"image {image}", "build it with `bash scripts/images.sh`")
    return env


def stack_files(home: Path) -> tuple[dict[str, str], dict[str, int], Path, Path]:
    """(passwords, published ports, the secrets folder, the compose env file) of a
    stack under ``home``, as scripts/env.sh writes them: one file each in a folder only
    root may enter, the URLs with the compose network's names."""
    pw = {k: secrets.token_hex(12) for k in ("redis", "postgres", "s3", "flower")}
    ports = {k: free_port() for k in ("redis", "postgres", "s3", "flower", "metrics")}
    vault = home / "secrets"
    _write_secrets(vault, {
        **{f"{k}_password": v for k, v in pw.items()},
        "broker_url": f"redis://:{pw['redis']}@redis:6379/0",
        "result_backend": f"redis://:{pw['redis']}@redis:6379/1",
        "database_url": f"postgresql+psycopg://fedq:{pw['postgres']}@postgres:5432/fedq"})
    env_file = home / "compose.env"
    env_file.write_text("".join(f"{k.upper()}_PORT={v}\n" for k, v in ports.items()) +
                        f"FEDQ_BIND=127.0.0.1\nSECRETS_DIR={vault}\n")
    return pw, ports, vault, env_file


@contextlib.contextmanager
def running(s: Stack) -> Iterator[Stack]:
    """``s`` up; then its worker containers removed and the stack down with its volumes."""
    try:
        s.up()
        yield s
    finally:
        for line in s.run("docker", "ps", "-aq", "--filter", f"name={s.project}-w",
                          check=False).split():
            s.run("docker", "rm", "-f", line, check=False)
        subprocess.run([*s.compose, "down", "-v", "--remove-orphans"], env=s.docker,
                       capture_output=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    docker = _docker_env()
    home = tmp_path_factory.mktemp("deploy")
    pw, ports, _, env_file = stack_files(home)
    urls = {
        "FEDQ_BROKER_URL": f"redis://:{pw['redis']}@127.0.0.1:{ports['redis']}/0",
        "FEDQ_RESULT_BACKEND": f"redis://:{pw['redis']}@127.0.0.1:{ports['redis']}/1",
        "FEDQ_DATABASE_URL":
            f"postgresql+psycopg://fedq:{pw['postgres']}@127.0.0.1:{ports['postgres']}/fedq",
        "FEDQ_BLOB_URL": "s3://fedq/blobs",
        "FEDQ_S3_ENDPOINT_URL": f"http://127.0.0.1:{ports['s3']}",
        "AWS_ACCESS_KEY_ID": "fedq", "AWS_SECRET_ACCESS_KEY": pw["s3"],
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    # a worker's folder, as docs/deploy.md writes it: its secrets and the settings
    worker_dir = home / "worker"
    _write_secrets(worker_dir, {"broker_url": urls["FEDQ_BROKER_URL"],
                                "result_backend": urls["FEDQ_RESULT_BACKEND"],
                                "s3_password": pw["s3"]})
    worker_env = worker_dir / "worker.env"
    worker_env.write_text(
        "FEDQ_BROKER_URL_FILE=/run/secrets/broker_url\n"
        "FEDQ_RESULT_BACKEND_FILE=/run/secrets/result_backend\n"
        "AWS_SECRET_ACCESS_KEY_FILE=/run/secrets/s3_password\n" +
        "".join(f"{k}={urls[k]}\n" for k in ("FEDQ_BLOB_URL", "FEDQ_S3_ENDPOINT_URL",
                                              "AWS_ACCESS_KEY_ID", "AWS_DEFAULT_REGION")))
    cli_env = {k: v for k, v in docker.items() if not k.startswith("FEDQ_")}
    cli_env.update(urls, FEDQ_HOME=str(home / "cli"))
    project = f"fedqt{uuid.uuid4().hex[:8]}"
    compose = ["docker-compose", "-p", project, "--env-file", str(env_file),
               "-f", str(ROOT / "docker" / "compose.yaml"),
               "-f", str(ROOT / "docker" / "compose.debian.yaml")]
    with running(Stack(docker, compose, project, Cluster(home, cli_env), worker_env, home,
                       ports, pw["flower"], list(pw.values()))) as s:
        yield s


def _submit(stack: Stack, **overrides: object) -> str:
    return stack.cli.submit({**JOB, **overrides})


def _wait(stack: Stack, job: str, timeout: float = 400) -> None:
    view = stack.cli.wait(job, timeout=timeout)
    assert view.status == "completed", view.error


def _each_round_once(stack: Stack, job: str, rounds: int) -> None:
    """Every round committed exactly once, with both its clients ok."""
    rows = stack.cli.rounds(job)
    assert [(r.number, r.status) for r in rows] == [(n, "committed")
                                                   for n in range(1, rounds + 1)]
    ok = [(u.round_number, u.client) for u in stack.cli.updates(job) if u.status == "ok"]
    assert len(ok) == len(set(ok)) == rounds * JOB["clients_per_round"]


def _mid_task(stack: Stack, container: str, job: str, number: int,
              timeout: float = 120) -> int:
    """Wait until the container's log shows a round-``number`` task received and not
    finished; returns its client."""
    def open_tasks() -> list[int]:
        log = stack.logs(container)
        got = re.findall(rf"Task fedq.train\[fedq-{job}-g\d+-r{number}-c(\d+)-a\d+\] received",
                         log)
        done = set(re.findall(rf"Task fedq.train\[fedq-{job}-g\d+-r{number}-c(\d+)-a\d+\] "
                              r"succeeded", log))
        return [int(c) for c in got if c not in done]

    return wait_until(open_tasks, timeout, interval=0.2, what=lambda: (
        f"a task of round {number} in {container}:\n{stack.logs(container)[-3000:]}"))[-1]


#: The secrets each service's role needs, and no more (docs/deploy.md's table).
ROLE_SECRETS = {
    "redis": {"redis_password"}, "postgres": {"postgres_password"}, "s3": {"s3_password"},
    "control": {"broker_url", "result_backend", "database_url", "s3_password"},
    "beat": {"broker_url"}, "flower": {"broker_url", "flower_password"},
    "metrics": {"broker_url", "database_url"},
}


def _mounted_secrets(stack: Stack, container: str) -> set[str]:
    mounts = json.loads(stack.run("docker", "inspect", "-f", "{{json .Mounts}}", container))
    return {m["Destination"].removeprefix("/run/secrets/") for m in mounts
            if m["Destination"].startswith("/run/secrets/")}


def test_stack_is_healthy_and_keeps_every_secret_in_files(stack: Stack) -> None:
    """No password on a command line (`docker top`) or anywhere `docker inspect` shows
    (environment, command, labels) of any service or worker container; each service
    holds the secrets of its role only; logs rotate; migrate ran once."""
    for service in ("beat", "flower", "metrics"):
        stack.wait_healthy(service)
    assert len(stack.passwords) == 4
    worker = stack.start_worker("w0")  # removed at the end: the kill test counts on w1, w2
    for service in ("redis", "control", "beat", "flower", "metrics", "postgres", "s3"):
        container = stack.container(service)
        top = stack.run("docker", "top", container, "-eo", "pid,args")
        assert len(top.splitlines()) >= 2, top  # the header and at least one process
        assert not any(p in top for p in stack.passwords), (service, top)
        assert _mounted_secrets(stack, container) == ROLE_SECRETS[service], service
    for container in [stack.container(s) for s in ROLE_SECRETS] + [worker]:
        inspect = stack.run("docker", "inspect", container)
        assert not any(p in inspect for p in stack.passwords), container
    assert _mounted_secrets(stack, worker) == {"broker_url", "result_backend", "s3_password"}
    stack.run("docker", "rm", "-f", worker)
    migrate = stack.run("docker", "ps", "-aq", "--filter", f"name={stack.project}_migrate")
    assert _mounted_secrets(stack, migrate.split()[0]) == {"database_url"}
    log_config = json.loads(stack.run("docker", "inspect", "-f", "{{json .HostConfig.LogConfig}}",
                                      stack.container("control")))
    assert log_config["Config"]["max-size"] == "10m"
    migrated = stack.run("docker", "ps", "-a", "--filter", f"name={stack.project}_migrate",
                         "--format", "{{.Status}}")
    assert migrated.startswith("Exited (0)"), migrated


def test_s3_stand_in_answers_only_on_its_authenticated_port(stack: Stack) -> None:
    """SeaweedFS's master, volume server and filer ask for no credentials: from the
    host, on the container's own address, they refuse connections; its S3 port answers
    and refuses an unsigned request."""
    import socket
    import urllib.error
    import urllib.request

    networks = json.loads(stack.run("docker", "inspect", "-f",
                                    "{{json .NetworkSettings.Networks}}", stack.container("s3")))
    address = next(iter(networks.values()))["IPAddress"]
    assert address
    for port in (9333, 19333, 8080, 18080, 8888, 18888, 8333, 18333):
        with socket.socket() as sock:
            sock.settimeout(5)
            assert sock.connect_ex((address, port)) != 0, f"{address}:{port} accepted"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://{address}:9000/fedq/", timeout=10)
    assert refused.value.code == 403


def _browser() -> Any:
    """Headless Chromium from Debian's packages (chromium, chromium-driver), driven by
    Selenium through the driver the package ships (no driver download)."""
    import shutil

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        missing("Chromium", "apt-get install chromium chromium-driver "
                            "(scripts/test-deploy.sh does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,900"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def _page_with(browser: Any, url: str, words: list[str], timeout: float = 60) -> str:
    """Open ``url``, reloading until every word is on the rendered page."""
    deadline = time.monotonic() + timeout
    while True:
        browser.get(url)
        time.sleep(1.5)  # Flower fills its tables by XHR after the page loads
        text = browser.find_element("tag name", "body").text
        if all(w in text for w in words) or time.monotonic() > deadline:
            assert all(w in text for w in words), (url, words, text[:2000])
            return text


def test_job_survives_a_worker_container_killed_mid_round(stack: Stack) -> None:
    """With the shipped 600 s deadline: the killed container's client is re-dispatched
    once its heartbeat stops (docs/reliability.md), within 30 s of the kill."""
    w1 = stack.start_worker("w1")
    w2 = stack.start_worker("w2")
    job = _submit(stack, rounds=3, round_timeout_s=600)
    client = _mid_task(stack, w1, job, 2)
    stack.run("docker", "kill", w1)
    killed_at = time.time()
    _wait(stack, job)
    _each_round_once(stack, job, 3)
    rows = {(u.round_number, u.client): u for u in stack.cli.updates(job)}
    assert rows[(2, client)].status == "ok"  # trained again, by the survivor
    assert rows[(2, client)].attempt > 1  # re-dispatched, not waited for
    with session_scope(stack.cli.env["FEDQ_DATABASE_URL"]) as s:
        resent = [aware(a.at).timestamp() - killed_at for a in s.scalars(
            select(WatchdogAction).where(WatchdogAction.job_id == job,
                                         WatchdogAction.round_number == 2,
                                         WatchdogAction.action.startswith("redispatch (lost")))]
    assert len(resent) == 1 and 0 < resent[0] <= 30, resent
    assert f"Task fedq.train[fedq-{job}-" in stack.logs(w2)
    workers = stack.cli.fedq("workers").stdout
    assert "w2@" in workers, workers


def test_control_restart_mid_job_loses_and_doubles_no_round(stack: Stack) -> None:
    if not stack.run("docker", "ps", "-q", "--filter", f"name={stack.project}-w2").strip():
        stack.start_worker("w2")
    job = _submit(stack, rounds=4)
    stack.cli.wait_for_round(job, 2, timeout=240)
    stack.compose_run("restart", "control")
    _wait(stack, job)
    _each_round_once(stack, job, 4)


def test_down_and_up_keeps_jobs_rounds_and_blobs_and_resume_continues(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedq.blobs import BlobRef, open_store

    if not stack.run("docker", "ps", "-q", "--filter", f"name={stack.project}-w2").strip():
        stack.start_worker("w2")
    done = _submit(stack, rounds=2)
    _wait(stack, done)
    before = stack.cli.results_json(done)
    job = _submit(stack, rounds=4)
    wait_until(lambda: [r.status for r in stack.cli.rounds(job)][:1] == ["committed"], 240,
               interval=1, what=f"round 1 of {job} to commit")
    stack.cli.fedq("cancel", job)
    stack.compose_run("down", timeout=300)  # volumes kept
    assert stack.container("control") == ""
    stack.up()

    assert stack.cli.results_json(done) == before  # the finished job, as it was
    last = stack.cli.rounds(done)[-1]
    settings = stack.cli.settings
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, stack.cli.env[name])  # boto3 reads them from here
    store = open_store(settings.blob_url, settings.s3_endpoint_url)
    assert last.global_key and last.global_sha256
    data = store.get(BlobRef(last.global_key, last.global_sha256, 0))  # sha256 checked
    assert len(data) > 0

    # round 1 was committed before the cancel; round 2 may have been too (round 1 is
    # quick now that workers rebuild round 0's model from the seed): resume goes on
    # after the last committed round
    committed = max(r.number for r in stack.cli.rounds(job) if r.status == "committed")
    out = stack.cli.fedq("resume", job).stdout
    assert committed in (1, 2) and f"resumed at round {committed + 1}" in out, out
    _wait(stack, job)
    _each_round_once(stack, job, 4)


def test_dashboard_in_a_real_browser_and_metrics_during_a_job(stack: Stack) -> None:
    """Flower with basic auth, opened in headless Chromium while a job runs: it lists
    fedq's tasks and the hardware queues; a screenshot is saved (docs/deploy.md shows
    it). The metrics service answers with the job's rounds."""
    import base64
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if not stack.run("docker", "ps", "-q", "--filter", f"name={stack.project}-w2").strip():
        stack.start_worker("w2")
    stack.wait_healthy("flower")
    stack.wait_healthy("metrics")
    job = _submit(stack, rounds=3)
    stack.cli.wait_for_round(job, 1, timeout=240)
    base = f"http://127.0.0.1:{stack.ports['flower']}"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(base + "/tasks", timeout=10)
    assert refused.value.code == 401  # no password, no dashboard

    browser = _browser()
    try:
        token = base64.b64encode(f"admin:{stack.flower_password}".encode()).decode()
        browser.execute_cdp_cmd("Network.enable", {})
        browser.execute_cdp_cmd("Network.setExtraHTTPHeaders",
                                {"headers": {"Authorization": f"Basic {token}"}})
        tasks = _page_with(browser, base + "/tasks", ["fedq.train", f"fedq-{job}-"])
        assert "fedq.finalize_round" in tasks or "fedq.start_round" in tasks, tasks[:2000]
        shots = Path(os.environ.get("FEDQ_TEST_SCREENSHOTS") or stack.home)
        shots.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(shots / "flower-tasks.png"))
        # Flower's Broker page lists the queues live workers consume (here: cpu; the
        # control worker's reply can miss its inspect window, so it is not required)
        _page_with(browser, base + "/broker", ["MESSAGE BROKER", "cpu"])
        assert browser.save_screenshot(str(shots / "flower-broker.png"))
        _page_with(browser, base + "/workers", ["control@", "w2@"])
    finally:
        browser.quit()
    assert (shots / "flower-tasks.png").stat().st_size > 10_000

    _wait(stack, job)
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.ports['metrics']}/metrics",
                                timeout=30) as response:
        text = response.read().decode()
    committed = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "fedq_rounds_total" and s.labels == {"job": job,
                                                                  "status": "committed"}]
    assert committed == [3]


def test_a_round_trained_on_the_pascal_and_the_new_gpu_images_together(stack: Stack) -> None:
    """The gpu_sm61 image's older torch (PyPI's 2.7.1+cu126) and the gpu_new image's
    (2.14.1+cu130) run fedq's worker code: one worker from each, on this machine's CPU,
    train a job's rounds together; every round commits with both their updates."""
    for line in stack.run("docker", "ps", "-aq", "--filter", f"name={stack.project}-w").split():
        stack.run("docker", "rm", "-f", line)  # only these two workers take the tasks
    old = stack.start_worker("wsm61", "fedq-worker:gpu_sm61")
    new = stack.start_worker("wnew", "fedq-worker:gpu_new")
    torch = {c: stack.run("docker", "exec", c, "python", "-c",
                          "import torch; print(torch.__version__)").strip() for c in (old, new)}
    assert torch[old].startswith("2.7.1") and not torch[new].startswith("2.7."), torch
    job = _submit(stack, rounds=2)
    _wait(stack, job)
    _each_round_once(stack, job, 2)
    by_round: dict[int, set[str]] = {}
    for u in stack.cli.updates(job):
        assert u.status == "ok", (u.client, u.error)
        by_round.setdefault(u.round_number, set()).add(u.worker.split("@")[0])
    assert set().union(*by_round.values()) == {"wsm61", "wnew"}, by_round


DEPLOY_GUIDE = ROOT / "docs" / "deploy.md"
GUIDE_FILES = [ROOT / "docker" / ".env", ROOT / "docker" / "secrets", ROOT / "worker",
               ROOT / "cli"]
SECURE_GUIDE_FILES = [ROOT / "docker" / ".env", ROOT / "docker" / "secrets",
                      ROOT / "docker" / "pki", ROOT / "laptop", ROOT / "laptop.bundle",
                      ROOT / "cli"]


def runnable_blocks(markdown: str, section: str = "") -> list[str]:
    """The guide's shell blocks marked ``<!-- runnable -->`` (``<!-- runnable: SECTION
    -->`` with a section), in order."""
    mark = f"runnable: {section}" if section else "runnable"
    return re.findall(rf"<!-- {mark} -->\n```bash\n(.*?)```", markdown, re.S)


def _run_guide(blocks: list[str], files: list[Path], compose: list[str],
               containers: list[str], volumes: list[str],
               path: str | None = None) -> str:
    """The blocks, verbatim and in order, in one `bash -c` in this checkout, with free
    ports and a compose project of its own (through the environment, as the guide says
    to set them); what they wrote, started and made is removed afterwards. Returns
    their output."""
    present = [str(p) for p in files if p.exists()]
    assert not present, f"the guide writes {present}: move them away to run this test"
    project = f"fedqguide{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "COMPOSE_PROJECT_NAME": project,
           **{name: str(free_port()) for name in ("REDIS_PORT", "POSTGRES_PORT", "S3_PORT",
                                                  "FLOWER_PORT", "METRICS_PORT")}}
    if path is not None:
        env["PATH"] = f"{env['PATH']}{os.pathsep}{path}"
    env = {k: v for k, v in env.items() if not k.startswith("FEDQ_")}
    script = "set -euo pipefail\n" + "\n".join(blocks)
    try:
        proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=1500, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-6000:]
        return out
    finally:
        for container in containers:
            subprocess.run(["docker", "rm", "-f", container], env=env, capture_output=True,
                           check=False)
        for volume in volumes:
            subprocess.run(["docker", "volume", "rm", volume], env=env, capture_output=True,
                           check=False)
        if (ROOT / "docker" / ".env").exists():
            subprocess.run(["bash", "scripts/compose.sh", *compose, "down", "-v"],
                           cwd=ROOT, env=env, capture_output=True, check=False, timeout=300)
        for path_ in files:
            if path_.is_dir():
                shutil.rmtree(path_)
            else:
                path_.unlink(missing_ok=True)


def test_the_guide_runs_as_written() -> None:
    """docs/deploy.md's runnable blocks, verbatim and in order, in one shell in this
    checkout: the engine, the images, docker/.env and docker/secrets/, `docker-compose
    up`, the worker's folder, a worker container, a submitted job watched to the end, and
    `down`. Only the ports are chosen (free ones, through the environment, as the guide
    says to), and the compose project's name, so that it does not meet the other tests'
    stack."""
    blocks = runnable_blocks(DEPLOY_GUIDE.read_text())
    assert len(blocks) == 5 and "scripts/compose.sh" in blocks[0] and "fedq watch" in blocks[3]
    out = _run_guide(blocks, GUIDE_FILES, ["--debian"], ["fedq-cpu-1"], [],
                     path=str(ROOT / ".venv" / "bin"))
    assert re.search(r"job \S+ completed at round 5/5", out), out[-4000:]
    assert "cpu-1" in out, out[-4000:]  # `fedq workers` lists the guide's worker


def test_the_secure_guide_runs_as_written() -> None:
    """docs/deploy.md's "stack with identity and TLS", its runnable blocks verbatim and in
    order: scripts/secure.sh and the secure stack up, `fedq worker add` in the control
    container, a worker container that joins with its own certificate, the host's CLI
    over TLS as a submitter role, a job; then `down` and `up` and a job, and a job with a
    Redis restart in its middle, each trained by the worker joined before (the stack's
    only worker: each fails if a restart loses its Redis user for good), and the stop.
    Its own PATH has no fedq: the blocks say where the CLI comes from."""
    blocks = runnable_blocks(DEPLOY_GUIDE.read_text(), "secure")
    assert len(blocks) == 6 and "--secure up" in blocks[0] and "restart redis" in blocks[4]
    out = _run_guide(blocks, SECURE_GUIDE_FILES, ["--debian", "--secure"], ["fedq-laptop"],
                     ["fedq-keys-laptop"])
    assert "joined as laptop" in out, out[-4000:]
    done = re.findall(r"job \S+ completed at round (\d+)/(\d+)", out)
    assert done == [("5", "5"), ("2", "2"), ("3", "3")], out[-6000:]
    assert "laptop@" in out, out[-4000:]  # `fedq workers` lists it by its Celery name
