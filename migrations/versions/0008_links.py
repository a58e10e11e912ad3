"""Links: which codec each update was sent with, and each worker's measured uplink.

client_updates gains ``codec`` (``none``/``fp16``/``int8``: with ``codec: auto`` it
differs from worker to worker) and the uplink speed the worker measured on its last
large upload (Mbit/s); workers gain the uplink speed (Mbit/s) and codec of
their last task, for ``fedq workers``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        batch.add_column(sa.Column("codec", sa.String(16), nullable=True))
        batch.add_column(sa.Column("uplink_mbit", sa.Float(), nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("uplink_mbit", sa.Float(), nullable=True))
        batch.add_column(sa.Column("codec", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("codec")
        batch.drop_column("uplink_mbit")
    with op.batch_alter_table("client_updates") as batch:
        batch.drop_column("uplink_mbit")
        batch.drop_column("codec")
