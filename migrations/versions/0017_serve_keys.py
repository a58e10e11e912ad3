"""API keys of ``fedq serve``, one per person or program.

``fedq serve-key add NAME`` keeps the sha256 of a new random key (the key is printed
once); ``fedq serve-key revoke NAME`` marks it revoked; a gateway refuses it from its
next read of the table on (fedq/inference/keys.py).

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26
"""
import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "serve_keys",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("key_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("serve_keys")
