"""Server optimizer state per job, privacy spent and compression per round.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("state_key", sa.String(300), nullable=True))
        batch.add_column(sa.Column("state_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("state_size", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(sa.Column("epsilon", sa.Float(), nullable=True))
        batch.add_column(sa.Column("raw_bytes_up", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("client_updates") as batch:
        batch.add_column(sa.Column("raw_bytes", sa.BigInteger(), nullable=False,
                                   server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        batch.drop_column("raw_bytes")
    with op.batch_alter_table("rounds") as batch:
        batch.drop_column("raw_bytes_up")
        batch.drop_column("epsilon")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("state_size")
        batch.drop_column("state_sha256")
        batch.drop_column("state_key")
