"""Model steps: the global model published as an int8 step from the previous one.

jobs gains the step blob's key, sha256 and size and the sha256 of the global blob it
steps from (``compression: {downlink: int8}``, fedq/aggregate/downlink.py); all null
when the job publishes no step (the default, and round 1).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("step_key", sa.String(300), nullable=True))
        batch.add_column(sa.Column("step_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("step_size", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("step_base", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("step_base")
        batch.drop_column("step_size")
        batch.drop_column("step_sha256")
        batch.drop_column("step_key")
