"""Untrusted workers: the version handshake and per-job watchdog errors.

workers gains the fedq version and message format each worker registered with
(fedq/wire.py: a worker of another format is refused and shown as incompatible);
watchdog_actions gains the one-line error of a job whose repair failed (the watchdog
repairs each job inside its own guard and goes on with the others).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("fedq_version", sa.String(32), nullable=True))
        batch.add_column(sa.Column("message_format", sa.Integer(), nullable=True))
    with op.batch_alter_table("watchdog_actions") as batch:
        batch.add_column(sa.Column("error", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("watchdog_actions") as batch:
        batch.drop_column("error")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("message_format")
        batch.drop_column("fedq_version")
