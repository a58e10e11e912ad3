"""The ``fedq`` command. It parses and prints; the work is in library functions."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from kombu.exceptions import BatchPublishError, OperationalError
from rich.markup import escape
from rich.table import Table

from fedq.cli.kinds import kind_of
from fedq.cli.output import err, fmt, job_json, out, status_style
from fedq.errors import ConfigError, FedqError, JobCancelled, JobFailed, ServiceUnavailable
from fedq.protocol.envelope import FEDQ_VERSION, MESSAGE_FORMAT
from fedq.status import JobStatus

F = TypeVar("F", bound=Callable[..., Any])

EXIT_CODES = """\b
Exit codes: 0 ok; 1 other expected failure; 2 bad input (spec, settings);
3 service unreachable or schema out of date; 4 no such job; 5 the watched job
failed; 6 it was cancelled; 7 watch --timeout ran out."""


def expected_errors(fn: F) -> F:
    """Turn FedqError into one red line on stderr and its exit code; no traceback. So
    too a send the broker refused (kombu's errors for it), with exit code 3."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FedqError as exc:
            for line in str(exc).splitlines() or [type(exc).__name__]:
                err.print(f"[bold red]fedq: error:[/] {escape(line)}", highlight=False,
                          soft_wrap=True)
            sys.exit(exc.exit_code)
        except (OperationalError, BatchPublishError) as exc:
            from fedq.engine.app import refusal

            err.print(f"[bold red]fedq: error:[/] the broker refused a send: "
                      f"{escape(refusal(exc))}", highlight=False, soft_wrap=True)
            sys.exit(ServiceUnavailable.exit_code)

    return wrapper  # type: ignore[return-value]


@click.group(epilog=EXIT_CODES)
@click.version_option(package_name="fedq")
def main() -> None:
    """fedq: federated training across the machines you already own, on Celery."""


def _settings() -> Any:
    from fedq.settings import get_settings

    return get_settings()


@main.command()
@click.argument("spec_paths", metavar="SPEC...", nargs=-1, required=True,
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="set a field of every SPEC before it is checked (repeat it): KEY a "
                   "dotted path such as model_args.path, VALUE read as YAML")
@expected_errors
def submit(spec_paths: tuple[Path, ...], sets: tuple[str, ...]) -> None:
    """Validate each SPEC (YAML or JSON) and start its job; prints one job id per line.

    All specs are validated before any job starts."""
    from fedq.coordinator.jobs import submit as submit_job
    from fedq.coordinator.planning import job_queues
    from fedq.spec import load_spec

    specs = [load_spec(path, sets) for path in spec_paths]
    settings = _settings()
    for spec in specs:
        click.echo(submit_job(settings, spec))
    _warn_idle(sorted({q for spec in specs for q in job_queues(spec)}))


def _warn_idle(queues: list[str], sent: dict[str, int] | None = None) -> None:
    """After a job is submitted: one warning line per queue it needs (the control
    queue first) that no live worker consumes; a failed inspect only loses the warning.
    ``sent``: tasks just sent to each queue. A worker busy in a task (``--pool solo``)
    answers no inspect, so a queue whose broker holds fewer messages than were sent to
    it has a consumer, answered or not."""
    from fedq.engine.broker import live_queues, queue_depths

    try:
        live = live_queues(timeout=1.0)
        if not live:  # no worker answered: a busy machine (or the embedded default's
            live = live_queues(timeout=3.0)  # polled broker) answers late; once more
        quiet = [q for q in queues if q not in live]
        depths = queue_depths(quiet) if sent and quiet else {}
    except Exception:  # noqa: BLE001 - the job is submitted either way
        return
    for queue in ["control", *queues]:
        if sent and queue in depths and depths[queue] < sent.get(queue, 0):
            continue  # something took this job's tasks
        if queue not in live:
            err.print(f"[yellow]warning:[/] no live worker consumes queue {queue!r}; "
                      f"its tasks wait until one starts "
                      f"(celery -A fedq worker -Q {queue})", highlight=False)


@main.command(epilog=EXIT_CODES)
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="follow the job with a progress bar until it finishes")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              help="with --wait: write the outputs here when it completes (JSONL; a "
                   "name ending .parquet: Parquet)")
@click.option("--timeout", default=0.0, help="--wait: give up after this many seconds")
@expected_errors
def infer(spec_path: Path, wait: bool, out_path: Path | None, timeout: float) -> None:
    """Start a batch inference job from SPEC (kind: inference); prints its id.

    Its shards run on the training queues' workers; paths in SPEC are relative to it."""
    from fedq.cli import infer as infer_cli
    from fedq.inference import jobs as infer_jobs
    from fedq.inference.jobs import REFUSED, find, merge
    from fedq.inference.spec import load_inference as load_infer_spec

    spec = load_infer_spec(spec_path)
    settings = _settings()
    job_id = infer_jobs.submit(settings, spec, spec_path.parent)
    click.echo(job_id)
    view = find(settings, job_id)
    sent: dict[str, int] = {}
    refused = None
    for row in view.shard_rows if view is not None else []:
        if row["status"] == "running" and row["queue"]:
            sent[row["queue"]] = sent.get(row["queue"], 0) + 1
        elif row["status"] == "queued" and (row["error"] or "").startswith(REFUSED):
            refused = row["error"]
    if refused is not None:
        err.print(f"[yellow]warning:[/] {escape(refused)}; the job's shards wait queued "
                  f"and the control worker sends them once the broker takes them (fedq "
                  f"watch {job_id})", highlight=False, soft_wrap=True)
    _warn_idle(list(spec.queues), sent)
    if not wait:
        return
    view = infer_cli.follow(settings, job_id, timeout=timeout or None, console=err)
    if view.status == JobStatus.FAILED:
        raise JobFailed(f"job {job_id} failed: {view.error}")
    if view.status == JobStatus.CANCELLED:
        raise JobCancelled(f"job {job_id} was cancelled")
    if view.status == JobStatus.RUNNING:
        from fedq.errors import WatchTimeout

        raise WatchTimeout(f"job {job_id} still running after {timeout:g}s "
                           f"(fedq watch {job_id})")
    if out_path is not None:
        lines = merge(settings, job_id, out_path)
        err.print(f"{lines} outputs written to {out_path}", highlight=False)


@main.command()
@click.argument("job_id", required=False)
@click.option("--weights", type=click.Path(dir_okay=False, path_type=Path),
              help="serve a safetensors file instead of a job's model (with --model, --dataset)")
@click.option("--hf", type=click.Path(file_okay=False, path_type=Path),
              help="serve a Hugging Face checkpoint folder as it is (config.json, "
                   "safetensors, tokenizer.json: what save_pretrained or fedq export writes)")
@click.option("--model", "model_name", help="--weights: the registry model it fits")
@click.option("--dataset", help="--weights: the data set that fixes its shapes")
@click.option("--model-args", default="{}", help="--weights: the model's arguments (JSON)")
@click.option("--dataset-args", default="{}",
              help="--weights: the data set's arguments (JSON); --hf: block_size")
@click.option("--queues", default="gpu_new,gpu_sm61,cpu", show_default=True,
              help="queues batches may go to; each batch goes where it is expected back soonest")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True)
@click.option("--max-batch", default=32, show_default=True, help="items per batch at most")
@click.option("--max-wait-ms", default=5.0, show_default=True,
              help="how long a batch waits for more items after its first")
@click.option("--max-queue", default=1024, show_default=True,
              help="items waiting or out before requests get 503")
@click.option("--batch-timeout-s", default=30.0, show_default=True,
              help="a batch with no answer by then is sent once more, then fails (504)")
@click.option("--max-body-bytes", type=int, default=None,
              help="a request body larger than this is refused (413); default: the largest "
                   "legal request for the model")
@click.option("--read-timeout-s", default=10.0, show_default=True,
              help="a request body not received whole by then is refused (408)")
@expected_errors
def serve(job_id: str | None, weights: Path | None, hf: Path | None, model_name: str | None,
          dataset: str | None, model_args: str, dataset_args: str, queues: str, host: str,
          port: int, max_batch: int, max_wait_ms: float, max_queue: int,
          batch_timeout_s: float, max_body_bytes: int | None, read_timeout_s: float) -> None:
    """Serve a trained model over HTTP: JOB (a completed training job's id, or latest),
    --weights or --hf. POST /v1/predict (classifiers) or /v1/completions,
    /v1/chat/completions and /v1/embeddings (language models, OpenAI-style); GET
    /v1/models, /health, /metrics. FEDQ_SERVE_API_KEY set: requests need
    'Authorization: Bearer KEY'. Batches run on the workers of --queues."""
    from pydantic import ValidationError

    from fedq.coordinator.enrol import registry
    from fedq.errors import SpecError
    from fedq.inference.spec import ModelSource
    from fedq.serve.app import http_stack, prepare, run
    from fedq.serve.keys import read as read_keys

    try:
        args = {"model_args": json.loads(model_args), "dataset_args": json.loads(dataset_args)}
        src = ModelSource(job=job_id, weights=str(weights) if weights else None,
                          hf=str(hf) if hf else None,
                          name=model_name, dataset=dataset, args=args["model_args"],
                          dataset_args=args["dataset_args"])
    except ValueError as exc:  # JSON, or the model source's own check
        text = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        raise SpecError(f"fedq serve: {text.removeprefix('Value error, ')}") from None
    wanted = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = [q for q in wanted if q not in ("gpu_new", "gpu_sm61", "cpu")]
    if unknown or not wanted:
        raise SpecError(f"--queues: {', '.join(unknown) or 'none given'}: not a training queue "
                        "(gpu_new, gpu_sm61, cpu)")
    for name, value in (("--max-batch", max_batch), ("--max-queue", max_queue)):
        if value < 1:
            raise SpecError(f"{name}: at least 1")
    if max_wait_ms < 0 or batch_timeout_s <= 0:
        raise SpecError("--max-wait-ms: 0 or more; --batch-timeout-s: more than 0")
    if (max_body_bytes is not None and max_body_bytes < 1) or read_timeout_s <= 0:
        raise SpecError("--max-body-bytes: at least 1; --read-timeout-s: more than 0")
    settings = _settings()
    served = prepare(settings, src, Path("."), wanted, max_batch=max_batch,
                     max_wait_ms=max_wait_ms, max_queue=max_queue,
                     batch_timeout_s=batch_timeout_s, api_key=settings.serve_api_key,
                     max_body=max_body_bytes, read_timeout_s=read_timeout_s,
                     read_registry=lambda: registry(settings.database_url),
                     read_key_table=lambda: read_keys(settings.database_url))
    err.print(f"fedq serve: {served.name} ({served.op}, {served.arch['name']}) on "
              f"http://{host}:{port} — POST /v1/"
              f"{'predict' if served.op == 'classify' else 'completions'}; batches of at most "
              f"{max_batch} after {max_wait_ms:g} ms to {', '.join(wanted)}"
              + ("; API key required" if served.api_key else "")
              + ("; the keys of `fedq serve-key` required" if read_keys(
                  settings.database_url).required else "")
              + "; HTTP: {} on {}".format(*http_stack()), highlight=False)
    run(served, host, port)


@main.group("serve-key")
def serve_key() -> None:
    """API keys of `fedq serve`, one per person or program: once one exists, every
    request needs an active key ('Authorization: Bearer KEY')."""


@serve_key.command("add")
@click.argument("name")
@expected_errors
def serve_key_add(name: str) -> None:
    """Make key NAME and print it (once: only its sha256 is kept)."""
    from fedq.serve import keys

    key = keys.add(_settings().database_url, name)
    out.print(key, highlight=False, soft_wrap=True)
    err.print(f"fedq: serve key {name}: give it to its user privately; running gateways "
              f"take it within 3 s. `fedq serve-key revoke {name}` ends it.", highlight=False)


@serve_key.command("list")
@expected_errors
def serve_key_list() -> None:
    """The keys: name, made, revoked."""
    from rich.table import Table

    from fedq.serve import keys

    table = Table("key", "made", "revoked")
    for row in keys.listed(_settings().database_url):
        table.add_row(row.name, row.created.isoformat(timespec="seconds"),
                      row.revoked.isoformat(timespec="seconds") if row.revoked else "-")
    out.print(table)


@serve_key.command("revoke")
@click.argument("name")
@expected_errors
def serve_key_revoke(name: str) -> None:
    """Revoke key NAME: running gateways refuse it within 3 s."""
    from fedq.serve import keys

    keys.revoke(_settings().database_url, name)
    out.print(f"serve key {name} revoked")


@main.command()
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@expected_errors
def status(job_id: str | None, as_json: bool) -> None:
    """Show one job, or the most recent jobs (training, then inference)."""
    from fedq.coordinator.jobs import list_jobs
    from fedq.inference.jobs import recent

    settings = _settings()
    if job_id:
        kind, view = kind_of(settings, job_id)
        kind.show(settings, job_id, view, as_json)
        return
    jobs, inferences = list_jobs(settings), recent(settings)
    if as_json:
        click.echo(json.dumps([job_json(j) for j in jobs] + inferences, indent=2))
        return
    if not jobs and not inferences:
        out.print("no jobs yet (fedq submit examples/digits.yaml)")
        return
    if jobs:
        table = Table("job", "name", "status", "round", "accuracy", "created", "error")
        for j in jobs:
            table.add_row(j.id, j.name, status_style(j.status),
                          f"{j.committed_round}/{j.total_rounds}", fmt(j.accuracy, ".4f"),
                          j.created_at, (j.error or "")[:80])
        out.print(table)
    if inferences:
        rows = Table("inference job", "name", "status", "op", "items", "created", "error")
        for r in inferences:
            rows.add_row(r["id"], r["name"], status_style(r["status"]), r["op"],
                         f"{r['done_items']}/{r['items']}", r["created_at"],
                         (r["error"] or "")[:80])
        out.print(rows)


@main.command()
@click.argument("job_id")
@click.option("--prompt", default="", help="text to continue (default: a new line)")
@click.option("--tokens", default=200, show_default=True, help="tokens to sample")
@click.option("--temperature", default=0.8, show_default=True)
@click.option("--top-k", default=40, show_default=True, help="0: no top-k cut")
@click.option("--seed", default=0, show_default=True)
@click.option("--chat", "message", default=None,
              help="a user message: print the model's reply, through its tokenizer's chat "
                   "template, up to its end-of-turn token (instead of --prompt)")
@expected_errors
def generate(job_id: str, prompt: str, tokens: int, temperature: float, top_k: int,
             seed: int, message: str | None) -> None:
    """Sample text from JOB's newest global model (a language-model job)."""
    from fedq.coordinator.generate import generate as sample

    if message is not None and prompt:
        raise ConfigError("give --prompt or --chat, not both")
    click.echo(sample(_settings(), job_id, prompt, tokens, temperature=temperature,
                      top_k=top_k or None, seed=seed, chat=message))


@main.command(name="export")
@click.argument("job_id")
@click.argument("folder", type=click.Path(path_type=Path))
@click.option("--adapter", is_flag=True,
              help="write the LoRA adapter alone (PEFT's form), not merged into the base")
@expected_errors
def export_model(job_id: str, folder: Path, adapter: bool) -> None:
    """Write JOB's newest global model into FOLDER (new or empty) as a Hugging Face
    checkpoint that plain transformers loads (an hf_causal_lm job)."""
    from fedq.coordinator.export import export

    with out.status(f"writing job {job_id}'s model"):
        number = export(_settings(), job_id, folder, adapter)
    click.echo(f"job {job_id} round {number}: written to {folder}"
               + (" (the LoRA adapter alone)" if adapter else ""))


@main.command(epilog=EXIT_CODES)
@click.argument("job_id")
@click.option("--interval", default=0.5, show_default=True, help="seconds between polls")
@click.option("--timeout", default=0.0, help="give up after this many seconds (0: never)")
@expected_errors
def watch(job_id: str, interval: float, timeout: float) -> None:
    """Follow JOB round by round until it finishes. Exits 0 when it completed, 5 when
    it failed, 6 when it was cancelled, 7 on --timeout, 4 for an unknown JOB."""
    settings = _settings()
    kind, _ = kind_of(settings, job_id)
    view = kind.follow(settings, job_id, interval, timeout or None)
    if view.status == JobStatus.RUNNING:
        from fedq.errors import WatchTimeout

        raise WatchTimeout(f"job {job_id} still running after {timeout:g}s")
    if view.status == JobStatus.FAILED:
        raise JobFailed(f"job {job_id} failed: {view.error}")
    if view.status == JobStatus.CANCELLED:
        raise JobCancelled(f"job {job_id} was cancelled")


@main.command()
@click.argument("job_id")
@expected_errors
def cancel(job_id: str) -> None:
    """Stop JOB: no more rounds (or shards), outstanding tasks revoked."""
    settings = _settings()
    kind, _ = kind_of(settings, job_id)
    revoked = kind.cancel(settings, job_id)
    click.echo(f"job {job_id} cancelled; {revoked} task(s) revoked")


@main.command()
@click.argument("job_id")
@expected_errors
def resume(job_id: str) -> None:
    """Restart a failed or cancelled JOB from its last committed round (an inference
    job: its unfinished shards)."""
    settings = _settings()
    kind, _ = kind_of(settings, job_id)
    click.echo(kind.resume(settings, job_id))


@main.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="print JSON (rounds and client rows)")
@click.option("--csv", "as_csv", is_flag=True, help="print CSV (one line per round)")
@click.option("--clients", "per_client", is_flag=True,
              help="also a table per client update: device, AMP, samples/s, GPU use")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              help="an inference job: write its outputs here, in input order (JSONL; a "
                   "name ending .parquet: Parquet)")
@expected_errors
def results(job_id: str, as_json: bool, as_csv: bool, per_client: bool,
            out_path: Path | None) -> None:
    """Per-round table of JOB: accuracy, loss, seconds, participants, bytes. For an
    inference job: items and throughput per worker; --out FILE merges its outputs."""
    settings = _settings()
    kind, view = kind_of(settings, job_id)
    kind.results(settings, job_id, view, as_json=as_json, as_csv=as_csv, per_client=per_client,
                 out_path=out_path)


def _print_links(links: dict[str, Any]) -> None:
    connect = links.get("broker_connect_seconds")
    out.print(f"broker    {links['broker']}: "
              + (f"connected in {connect * 1000:.0f} ms" if connect is not None
                 else "[red]not reachable[/]"), highlight=False)
    if links.get("upload_seconds") is not None:
        out.print(f"blobs     {links['blob_store']}: 10 MB up {links['upload_seconds']:.2f} s "
                  f"({links['upload_mb_per_s']:.0f} MB/s), down "
                  f"{links['download_seconds']:.2f} s ({links['download_mb_per_s']:.0f} MB/s)",
                  highlight=False)
    else:
        out.print(f"blobs     {links['blob_store']}: [red]not reachable[/]", highlight=False)
    if links.get("blob_layout"):
        out.print(f"          {links['blob_layout']}", highlight=False)
    if links.get("blob_room"):
        out.print(f"          {links['blob_room']}", highlight=False)
    limits = links.get("limits") or []
    if limits:
        who = (f"registered worker {links['joined_as']}" if links.get("joined_as")
               else "this shell (not a joined worker: a worker given these credentials "
                    "could do what does not hold)")
        out.print(f"limits    of {who}:", highlight=False)
        mark = {True: "[green]holds[/]", False: "[red]does not hold[/]",
                None: "[yellow]not checked[/]"}
        for limit in limits:
            out.print(f"  {mark[limit['holds']]}  {limit['what']}: {limit['detail']}",
                      highlight=False)


def _ago(iso: str | None) -> str:
    """'12s ago' / '5m ago' / '3h ago' / '2d ago' for an ISO time; '-' for none."""
    if not iso:
        return "-"
    from datetime import datetime, timezone

    seconds = (datetime.now(timezone.utc) - datetime.fromisoformat(iso)).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{max(seconds, 0):.0f}s ago"


@main.command()
@click.option("--timeout", default=1.0, show_default=True, help="seconds to wait for replies")
@expected_errors
def workers(timeout: float) -> None:
    """Workers: live status (Celery inspect; ``away`` with the reason while a worker
    steps aside for its machine's owner), hardware, torch build, measured throughput,
    tasks done and failed, GPU memory and utilisation of the last task, last heartbeat."""
    from fedq.coordinator.roster import roster
    from fedq.engine.names import LOST_REASON, STOPPED_REASON

    rows = roster(_settings(), timeout=timeout)
    if not rows:
        out.print("no workers (start one: celery -A fedq worker -Q cpu)")
        return
    table = Table("worker", "status", "queues", "running", "hardware", "torch", "samples/s",
                  "done", "failed", "GPU MB / %", "uplink", "last task", "last seen")
    for w in rows:
        status = "[red]incompatible[/]" if w.problem else \
            f"[yellow]away: {w.away_reason} ({_ago(w.available_since)})[/]" \
            if w.live and w.available is False else \
            "[green]live[/]" if w.live else \
            f"[dim]stopped ({_ago(w.available_since)})[/]" if w.away_reason == STOPPED_REASON \
            else f"[red]lost: heartbeat stopped ({_ago(w.available_since)})[/]" \
            if w.away_reason == LOST_REASON else "[dim]gone[/]"
        gpu = f"{fmt(w.gpu_peak_mb, '.0f')} / {fmt(w.gpu_util, '.0f')}" \
            if w.gpu_peak_mb is not None else "-"
        table.add_row(w.host, status, ",".join(w.queues),
                      "-" if w.running is None else str(w.running), w.hardware, w.torch,
                      fmt(w.samples_per_second, ".0f"), str(w.tasks_done),
                      f"[red]{w.tasks_failed}[/]" if w.tasks_failed else "0", gpu, w.uplink,
                      _ago(w.last_task), _ago(w.last_seen))
    out.print(table)
    for w in rows:
        if w.problem:
            out.print(f"{w.host}: {w.problem}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--smoke", is_flag=True,
              help="then train one real round here: a worker on this machine's queue, "
                   "ResNet-18 on CIFAR-shaped data; prints samples/s and GPU use")
@click.option("--steps", default=200, show_default=True, help="--smoke: training steps")
@click.option("--batch-size", default=256, show_default=True, help="--smoke: batch size")
@click.option("--home", default=".fedq/smoke", show_default=True,
              help="--smoke: folder for its state")
@click.option("--services", is_flag=True,
              help="also connect to the broker, time a 10 MB blob to and from the "
                   "blob store and check which of a registered worker's limits hold "
                   "(the FEDQ_* settings of this shell)")
@expected_errors
def doctor(as_json: bool, smoke: bool, steps: int, batch_size: int, home: str,
           services: bool) -> None:
    """Check this machine: hardware class, torch build vs GPU, a kernel smoke test,
    and (--services) the connection to the broker and the blob store and which of a
    registered worker's limits its credentials keep (docs/security.md).

    Exits 1 when the installed torch cannot drive a GPU here, with the fix, or when a
    service cannot be reached."""
    from fedq.worker.doctor import checkup
    from fedq.worker.hardware import amp_mode, arch_covers, image_for

    if as_json or not services:
        found = checkup(_settings(), services=services)
    else:
        with out.status("connecting to the broker; a 10 MB blob to and from the store"):
            found = checkup(_settings(), services=services)
    report, problems, image, links = found.report, found.problems, found.image, found.links
    cls = report.hardware_class
    if services:
        from fedq.coordinator.roster import incompatible_workers

        problems += incompatible_workers(_settings())
    if as_json and not smoke:
        click.echo(json.dumps({**report.to_json(), "image": image, "services": links,
                               "owner": found.owner,
                               "fedq": {"version": FEDQ_VERSION,
                                        "message_format": MESSAGE_FORMAT},
                               "problems": problems}, indent=2))
        sys.exit(1 if problems else 0)
    if as_json:  # --smoke --json: the report and the round, one document
        if problems:
            click.echo(json.dumps({**report.to_json(), "problems": problems}, indent=2))
            sys.exit(1)
        from fedq.cli.smoke import run_smoke

        measured = run_smoke(Path(home), report, steps=steps, batch_size=batch_size)
        click.echo(json.dumps({**report.to_json(), "problems": [], "smoke": measured},
                              indent=2))
        return
    out.print(f"host      {report.hostname}", highlight=False)
    out.print(f"fedq      {FEDQ_VERSION}, message format {MESSAGE_FORMAT} (a coordinator and "
              f"its workers must speak the same)", highlight=False)
    out.print(f"torch     {report.torch} (CUDA build {report.cuda or 'none'}), driver "
              f"{report.driver or 'none'}", highlight=False)
    if report.arch_list or report.build_arch:
        out.print(f"kernels   {' '.join(report.arch_list or report.build_arch)}",
                  highlight=False)
    if image is not None:
        out.print(f"image     fedq image for {image['class']}: "
                  f"{'as pinned' if not image['problems'] else 'differs from pins.toml'}",
                  highlight=False)
    if report.gpus:
        table = Table("gpu", "name", "capability", "memory GB", "kernels", "AMP")
        for g in report.gpus:
            ok = arch_covers(g.capability, report.arch_list)
            table.add_row(str(g.index), g.name, f"{g.capability[0]}.{g.capability[1]}",
                          f"{g.memory_gb:.1f}", "[green]yes[/]" if ok else "[red]missing[/]",
                          amp_mode(g.capability, _settings().amp))
        out.print(table)
    else:
        out.print("gpus      none" + (" (Apple MPS available: it trains on MPS and joins "
                                       "the cpu queue)" if report.mps else ""), highlight=False)
    if report.jetson:
        out.print("jetson    yes: use NVIDIA's JetPack torch, not PyPI wheels (docs/hardware.md)")
    if links is not None:
        _print_links(links)
    if found.owner is not None:
        now = found.owner["now"]
        out.print(f"owner     trains {found.owner['policy']}: "
                  + (f"[yellow]stepping aside now ({now})[/]" if now else "may train now"),
                  highlight=False)
        for p in found.owner["probes"]:
            out.print(f"  probe   {p['name']}: {p['reads']}", highlight=False)
    out.print(f"class     {cls}: start a worker with "
              f"[bold]celery -A fedq worker -Q {cls} -c 1[/] or the image {image_for(cls)}",
              highlight=False)
    if problems:
        for problem in problems:
            err.print(f"[bold red]problem:[/] {problem}", highlight=False, soft_wrap=True)
        sys.exit(1)
    out.print("[green]ok[/]: this machine can train for fedq")
    if smoke:
        from fedq.cli.smoke import run_smoke

        with out.status(f"training one round of ResNet-18 on queue {cls} ({steps} steps)"):
            m = run_smoke(Path(home), report, steps=steps, batch_size=batch_size)
        table = Table("queue", "device", "AMP", "steps x batch", "samples/s", "train s",
                      "GPU peak MB", "GPU util %", "round s", title="smoke round")
        table.add_row(m["queue"], m["device"], m["amp"], f"{m['steps']} x {m['batch_size']}",
                      fmt(m["samples_per_second"], ".0f"), fmt(m["train_seconds"], ".2f"),
                      fmt(m["gpu_peak_mb"], ".0f"), fmt(m["gpu_util_percent"], ".0f"),
                      fmt(m["round_seconds"], ".2f"))
        out.print(table)


@main.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command()
@expected_errors
def upgrade() -> None:
    """Migrate the database to the newest schema."""
    from fedq.db import upgrade as do_upgrade
    from fedq.db.session import current_revision

    settings = _settings()
    do_upgrade(settings.database_url)
    click.echo(f"database at revision {current_revision(settings.database_url)}")


@db.command("role")
@click.argument("name")
@click.option("--kind", type=click.Choice(["coordinator", "submitter"]), required=True,
              help="coordinator: the control worker and beat; submitter: a person's CLI")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              help="write the role's database URL to this file (mode 600), not stdout")
@click.option("--password-file", type=click.Path(dir_okay=False, path_type=Path),
              help="set the password held in this file (the role's database URL, as a "
                   "service will read it, or the password alone) instead of a new one")
@expected_errors
def role(name: str, kind: str, out_path: Path | None, password_file: Path | None) -> None:
    """Make PostgreSQL login role NAME with only what KIND needs (run as the schema
    owner, after `fedq db upgrade`); prints its database URL, with a new password
    (or the one --password-file holds)."""
    from fedq.db.roles import grant

    password = None if password_file is None else _password_in(password_file, name)
    url = grant(_settings().database_url, name, kind, password)  # type: ignore[arg-type]
    if password_file is not None and out_path is None:  # its holder has the URL already
        click.echo(f"role {name} ({kind}): password set from {password_file}")
        return
    if out_path is None:
        click.echo(url)
        return
    import os

    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url + "\n")
    click.echo(f"wrote {out_path}: the database URL of role {name} ({kind})")


def _password_in(path: Path, role: str) -> str:
    """The password ``path`` holds: a database URL's (which must name ``role``) or the
    whole file."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--password-file {path}: cannot read it ({exc})") from None
    if "://" in text:
        try:
            url = make_url(text)
        except ArgumentError:
            raise ConfigError(f"--password-file {path}: not a database URL") from None
        if url.username != role or not url.password:
            raise ConfigError(f"--password-file {path}: its URL is not role {role}'s "
                              f"with a password")
        text = str(url.password)
    if len(text) < 16:
        raise ConfigError(f"--password-file {path}: the password is shorter than 16 "
                          f"characters")
    return text


@main.group()
def store() -> None:
    """The blob store (weights and updates)."""


@store.command("init")
@click.option("--wait", default=60.0, show_default=True,
              help="seconds to keep retrying while the store's server starts")
@expected_errors
def store_init(wait: float) -> None:
    """Create the S3 bucket unless it exists and check the store can be written."""
    from fedq.coordinator.jobs import prepare_store

    click.echo(prepare_store(_settings(), wait=wait))


@main.command()
@click.option("--rounds", default=None, type=int, help="rounds to run (default: the spec's)")
@click.option("--workers", "n_workers", default=3, show_default=True, help="training workers")
@click.option("--home", default=".fedq/demo", show_default=True, help="folder for its state")
@expected_errors
def demo(rounds: int | None, n_workers: int, home: str) -> None:
    """Train on scikit-learn's digits over real Celery workers, with no servers."""
    from fedq.cli.demo import run_demo

    sys.exit(run_demo(Path(home), rounds=rounds, n_workers=n_workers, console=out))


if __name__ == "__main__":
    main()
