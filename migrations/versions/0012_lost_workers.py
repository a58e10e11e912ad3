"""Lost workers: the claims of training tasks that have started, with their heartbeat.

A training task writes its claim (worker, heartbeat counter) to the result backend when
it starts and every FEDQ_HEARTBEAT_S while it runs; the watchdog copies what it reads
into ``claims`` with the time it last saw the counter move (its own clock, never the
worker's). A claim silent for FEDQ_WORKER_LOST_S is lost and its task is sent again
(fedq/coordinator/liveness.py).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "claims",
        sa.Column("task_id", sa.String(200), primary_key=True),
        sa.Column("job_id", sa.String(64), nullable=False, index=True),
        sa.Column("client", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("beat", sa.Integer(), nullable=False),
        sa.Column("moved_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resent_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("claims")
