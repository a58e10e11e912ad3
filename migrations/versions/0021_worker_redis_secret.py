"""The SHA-256 of each registered worker's Redis password, so that its Redis user can
be made again from the registry (a Redis restarted without its ACL: the watchdog
restores every missing user, fedq/coordinator/enrol.py ``restore_users``). Redis
takes a user's password as this hash (``ACL SETUSER name #<sha256>``); the password
itself stays in the worker's bundle only.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("registered_workers") as batch:
        batch.add_column(sa.Column("redis_secret", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("registered_workers") as batch:
        batch.drop_column("redis_secret")
