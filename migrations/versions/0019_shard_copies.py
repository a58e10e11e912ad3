"""Backup copies counted over an inference job's whole life.

``backups`` (0018) restarts from 0 when a job resumes, because the copies out before
the resume were revoked and must not count as copies of the new attempt. What a person
reads (``fedq watch``, ``fedq results``, the report) counted re-sends as the attempts
that were not copies, so after a resume an old copy read as a re-send. ``copies``
keeps every copy sent; rows written before this revision start from their ``backups``.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("inference_shards") as batch:
        batch.add_column(sa.Column("copies", sa.Integer(), nullable=False,
                                   server_default="0"))
    op.execute("UPDATE inference_shards SET copies = backups")


def downgrade() -> None:
    with op.batch_alter_table("inference_shards") as batch:
        batch.drop_column("copies")
