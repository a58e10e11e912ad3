"""Initial schema: jobs, rounds, client updates, workers.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("total_rounds", sa.Integer(), nullable=False),
        sa.Column("committed_round", sa.Integer(), nullable=False),
        sa.Column("global_key", sa.String(300), nullable=False),
        sa.Column("global_sha256", sa.String(64), nullable=False),
        sa.Column("global_size", sa.BigInteger(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("updated_at", TZ, nullable=False),
        sa.Column("finished_at", TZ, nullable=True),
    )
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_table(
        "rounds",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("planned", sa.JSON(), nullable=False),
        sa.Column("chord_id", sa.String(64), nullable=True),
        sa.Column("started_at", TZ, nullable=False),
        sa.Column("finished_at", TZ, nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("participants", sa.Integer(), nullable=True),
        sa.Column("samples", sa.BigInteger(), nullable=True),
        sa.Column("train_loss", sa.Float(), nullable=True),
        sa.Column("eval_loss", sa.Float(), nullable=True),
        sa.Column("accuracy", sa.Float(), nullable=True),
        sa.Column("bytes_up", sa.BigInteger(), nullable=True),
        sa.Column("bytes_down", sa.BigInteger(), nullable=True),
        sa.Column("global_key", sa.String(300), nullable=True),
        sa.Column("global_sha256", sa.String(64), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.UniqueConstraint("job_id", "number", name="uq_rounds_job_number"),
        # round ids name task generations: SQLite must never reuse a deleted one
        sqlite_autoincrement=True,
    )
    op.create_index("ix_rounds_job_id", "rounds", ["job_id"])
    op.create_index("ix_rounds_status", "rounds", ["status"])
    op.create_table(
        "client_updates",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("round_number", sa.Integer(), nullable=False),
        sa.Column("client", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("queue", sa.String(32), nullable=True),
        sa.Column("worker", sa.String(200), nullable=True),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("bytes_up", sa.BigInteger(), nullable=False),
        sa.Column("bytes_down", sa.BigInteger(), nullable=False),
        sa.Column("update_norm", sa.Float(), nullable=True),
        sa.Column("blob_key", sa.String(300), nullable=True),
        sa.Column("blob_sha256", sa.String(64), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.UniqueConstraint("job_id", "round_number", "client",
                            name="uq_updates_job_round_client"),
    )
    op.create_index("ix_client_updates_job_id", "client_updates", ["job_id"])
    op.create_table(
        "workers",
        sa.Column("hostname", sa.String(200), primary_key=True),
        sa.Column("queues", sa.JSON(), nullable=False),
        sa.Column("hardware", sa.JSON(), nullable=False),
        sa.Column("tasks_done", sa.Integer(), nullable=False),
        sa.Column("samples_per_second", sa.Float(), nullable=True),
        sa.Column("first_seen", TZ, nullable=False),
        sa.Column("last_seen", TZ, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_table("client_updates")
    op.drop_table("rounds")
    op.drop_table("jobs")
