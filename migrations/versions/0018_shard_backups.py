"""Backup copies of an inference job's last shards.

Once no shard of a job waits, a queue's free slot runs a second copy of the shard out
longest, and the first answer counts (fedq/inference/jobs.py). ``backups`` counts the
copies a shard was sent as, so they do not count against ``max_redispatch``. Rows of
jobs submitted before this revision read 0: no copy was sent for them.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28
"""
import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("inference_shards") as batch:
        batch.add_column(sa.Column("backups", sa.Integer(), nullable=False,
                                   server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("inference_shards") as batch:
        batch.drop_column("backups")
