"""Each training task's peak resident memory on its worker, in MB
(fedq.protocol.training.TrainStats ``host_peak_mb``): what a large model costs the
machine that trains it.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07
"""
import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        batch.add_column(sa.Column("host_peak_mb", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        batch.drop_column("host_peak_mb")
