"""How each client update was trained: loop time, device, AMP, budget stop, GPU use,
tokens.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        batch.add_column(sa.Column("train_seconds", sa.Float(), nullable=True))
        batch.add_column(sa.Column("device", sa.String(32), nullable=True))
        batch.add_column(sa.Column("amp", sa.String(8), nullable=True))
        batch.add_column(sa.Column("stopped_by_budget", sa.Boolean(), nullable=True))
        batch.add_column(sa.Column("gpu_peak_mb", sa.Float(), nullable=True))
        batch.add_column(sa.Column("gpu_util", sa.Float(), nullable=True))
        batch.add_column(sa.Column("tokens", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        for name in ("tokens", "gpu_util", "gpu_peak_mb", "stopped_by_budget", "amp", "device",
                     "train_seconds"):
            batch.drop_column(name)
