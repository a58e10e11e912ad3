"""The registered worker a hostname belongs to.

With ``FEDQ_IDENTITY=required`` a worker's own control messages (``fedq.register_worker``
at start, ``fedq.worker_state`` when it steps aside for its owner) are signed; the
first signed one for a hostname binds it to its signer (``workers.signer``), and a
message for that hostname signed by another registered worker is refused.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26
"""
import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("signer", sa.String(48), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("signer")
