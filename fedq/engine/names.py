"""Queue and task names, and the time limits of each task type.

Imported by both sides of the wire and by the job spec; no Celery import here, so
the spec and the aggregation math can name queues without loading Celery.
"""

from __future__ import annotations

CONTROL_QUEUE = "control"
#: The control queue's exchange: a topic exchange of another name, so that Celery
#: publishes to it by name (never through RabbitMQ's default exchange, which reaches
#: every queue) and a right to send to it is not a right to read the queue
#: (fedq/coordinator/rabbit.py).
CONTROL_EXCHANGE = "fedq.control"
TRAINING_QUEUES = ("gpu_new", "gpu_sm61", "cpu")
GPU_QUEUES = ("gpu_new", "gpu_sm61")
ALL_QUEUES = (CONTROL_QUEUE, *TRAINING_QUEUES)
#: A data site's queue: ``site.<name>``. A job with ``sites`` (docs/owners.md) sends
#: each client's task to the queue of the site that holds its data, and only the
#: workers at that site consume it (``-Q cpu,site.<name>``).
SITE_PREFIX = "site."
#: A site's name: short enough that its queue name stays within the wire's 32 bytes.
SITE_NAME_PATTERN = r"[a-z0-9][a-z0-9_-]{0,26}"


def site_queue(site: str) -> str:
    """The queue of data site ``site``."""
    return SITE_PREFIX + site


TRAIN_TASK = "fedq.train"
START_ROUND_TASK = "fedq.start_round"
FINALIZE_ROUND_TASK = "fedq.finalize_round"
ABSORB_UPDATE_TASK = "fedq.absorb_update"
REGISTER_WORKER_TASK = "fedq.register_worker"
WORKER_STATE_TASK = "fedq.worker_state"
#: The reason a worker reports when it shuts down (a warm or cold stop, not a kill):
#: away until it starts again and registers (fedq/worker/signals.py, roster).
STOPPED_REASON = "worker stopped"
#: The reason the coordinator records for a site's worker whose task's heartbeat stopped
#: (killed, hung, lost its link): away until it registers again or a heartbeat of its
#: moves (fedq/coordinator/roster.py ``mark_lost``).
LOST_REASON = "heartbeat lost"
JOIN_WORKER_TASK = "fedq.join_worker"
WATCHDOG_TASK = "fedq.watchdog"

# A training task may run for a long time on a slow machine; control tasks are short.
TRAIN_SOFT_TIME_LIMIT = 3600
TRAIN_TIME_LIMIT = 3900
CONTROL_TIME_LIMIT = 600

# Batch inference (fedq/inference/): one shard per task on a hardware queue; its
# answer's callback on the control queue.
INFER_TASK = "fedq.infer_shard"
ABSORB_SHARD_TASK = "fedq.absorb_shard"
# fedq serve: one batch of requests per task on a hardware queue.
SERVE_TASK = "fedq.serve_batch"

#: The state a served batch's worker writes while it generates: ``{"stream": [text so
#: far of each item]}`` (fedq/tasks/infer.py), which the gateway turns into a streamed
#: answer (fedq/serve/results.py, where it is checked like everything a worker sends).
STREAM_STATE = "STREAMING"
