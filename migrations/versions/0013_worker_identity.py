"""Worker identity: registered workers with their Ed25519 public keys, and the signer
of each update.

``fedq worker add NAME`` writes an ``invited`` row with the sha256 of a one-time token;
``fedq worker join`` on the worker's machine proves the token and registers the public
key of a key made there (``active``); ``fedq worker revoke NAME`` makes it ``revoked``.
With FEDQ_IDENTITY=required the coordinator admits only results signed by an active
worker and records the signer (fedq/identity.py, docs/security.md).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "registered_workers",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("queues", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("token_sha256", sa.String(64), nullable=True),
        sa.Column("public_key", sa.String(64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("joined_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    with op.batch_alter_table("client_updates") as batch:
        batch.add_column(sa.Column("signer", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("client_updates") as batch:
        batch.drop_column("signer")
    op.drop_table("registered_workers")
