"""Client updates record the samples processed (differs from the shard size under a
time budget or a step count).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        batch.add_column(sa.Column("processed", sa.Integer(), nullable=False,
                                   server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        batch.drop_column("processed")
