"""The owner comes first: each worker's availability, its history, and partial updates.

A worker with a run policy (fedq/worker/owner.py) reports when it steps aside for the
machine's owner and when it comes back: ``workers.available`` with the reason and
since when (``fedq workers``), and one ``worker_availability`` row per change (the
bands of ``fedq plot``). A task stopped for the owner with enough done uploads a
partial update: ``client_updates.yielded``.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("available", sa.Boolean, nullable=True))
        batch.add_column(sa.Column("away_reason", sa.String(200), nullable=True))
        batch.add_column(sa.Column("available_since", sa.DateTime(timezone=True),
                                   nullable=True))
    op.create_table(
        "worker_availability",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("hostname", sa.String(200), nullable=False, index=True),
        sa.Column("available", sa.Boolean, nullable=False),
        sa.Column("reason", sa.String(200), nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("client_updates") as batch:
        batch.add_column(sa.Column("yielded", sa.Boolean, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        batch.drop_column("yielded")
    op.drop_table("worker_availability")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("available_since")
        batch.drop_column("away_reason")
        batch.drop_column("available")
