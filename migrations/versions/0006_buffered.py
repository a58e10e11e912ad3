"""Buffered asynchronous aggregation: a client_updates row per training task, with the
model version it trained from, its staleness and its weight.

A buffered job's row is written when its task is dispatched (status ``training``),
absorbed into the version being filled (``buffered``), then marked ``ok``,
``rejected``, ``stale``, ``error`` or ``missing``. ``task_index`` numbers a buffered
job's tasks from 1 (0 for synchronous rows), so the unique key gains it: one client
may train several times towards one version.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        batch.add_column(sa.Column("task_index", sa.Integer(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("attempt", sa.Integer(), nullable=False,
                                   server_default="1"))
        batch.add_column(sa.Column("base_version", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("staleness", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("weight", sa.Float(), nullable=True))
        batch.drop_constraint("uq_updates_job_round_client", type_="unique")
        batch.create_unique_constraint("uq_updates_job_round_client_task",
                                       ["job_id", "round_number", "client", "task_index"])
    op.create_index("ix_updates_job_task", "client_updates", ["job_id", "task_index"])


def downgrade() -> None:
    op.drop_index("ix_updates_job_task", "client_updates")
    with op.batch_alter_table("client_updates") as batch:
        batch.drop_constraint("uq_updates_job_round_client_task", type_="unique")
        batch.create_unique_constraint("uq_updates_job_round_client",
                                       ["job_id", "round_number", "client"])
        for name in ("weight", "staleness", "base_version", "attempt", "task_index"):
            batch.drop_column(name)
