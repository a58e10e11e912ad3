"""Observability: where each client task's time went, the finalize step's time, and
per-worker diagnostics.

client_updates gains the task's start on the worker's clock (``started_at``) and the
seconds spent downloading the global model and uploading the update (training is
``train_seconds``); queue wait is ``started_at`` minus the dispatch time. rounds gains
``finalize_seconds``. workers gains failed tasks and the GPU memory and utilisation
sampled during its last task. ``watchdog_actions`` records each repair the watchdog
made (for ``fedq metrics`` and ``fedq report``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "watchdog_actions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=False, index=True),
        sa.Column("round_number", sa.Integer(), nullable=True),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("result", sa.String(32), nullable=True),
    )
    with op.batch_alter_table("client_updates") as batch:
        batch.add_column(sa.Column("started_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("download_seconds", sa.Float(), nullable=True))
        batch.add_column(sa.Column("upload_seconds", sa.Float(), nullable=True))
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(sa.Column("finalize_seconds", sa.Float(), nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("tasks_failed", sa.Integer(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("gpu_peak_mb", sa.Float(), nullable=True))
        batch.add_column(sa.Column("gpu_util", sa.Float(), nullable=True))
        batch.add_column(sa.Column("last_task_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_table("watchdog_actions")
    with op.batch_alter_table("workers") as batch:
        for name in ("last_task_at", "gpu_util", "gpu_peak_mb", "tasks_failed"):
            batch.drop_column(name)
    with op.batch_alter_table("rounds") as batch:
        batch.drop_column("finalize_seconds")
    with op.batch_alter_table("client_updates") as batch:
        for name in ("upload_seconds", "download_seconds", "started_at"):
            batch.drop_column(name)
