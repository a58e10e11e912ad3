"""Batch inference jobs: ``inference_jobs`` and one ``inference_shards`` row per shard
(fedq/inference/jobs.py).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "inference_jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("items", sa.Integer, nullable=False),
        sa.Column("shards", sa.Integer, nullable=False),
        sa.Column("model_key", sa.String(300), nullable=False),
        sa.Column("model_sha256", sa.String(64), nullable=False),
        sa.Column("model_size", sa.BigInteger, nullable=False),
        sa.Column("arch", sa.JSON, nullable=False),
        sa.Column("classes", sa.Integer, nullable=False),
        sa.Column("inputs_key", sa.String(300), nullable=True),
        sa.Column("inputs_sha256", sa.String(64), nullable=True),
        sa.Column("inputs_size", sa.BigInteger, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "inference_shards",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("inference_jobs.id"), nullable=False,
                  index=True),
        sa.Column("shard", sa.Integer, nullable=False),
        sa.Column("start", sa.Integer, nullable=False),
        sa.Column("stop", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("spared", sa.Integer, nullable=False),
        sa.Column("queue", sa.String(32), nullable=True),
        sa.Column("worker", sa.String(200), nullable=True),
        sa.Column("key", sa.String(300), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("size", sa.BigInteger, nullable=True),
        sa.Column("seconds", sa.Float, nullable=True),
        sa.Column("device", sa.String(32), nullable=True),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("done_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.UniqueConstraint("job_id", "shard"),
    )


def downgrade() -> None:
    op.drop_table("inference_shards")
    op.drop_table("inference_jobs")
