"""One name per thing: a buffered version's fill time gets its own column, and the
round column nothing ever wrote goes.

rounds.full_since: when a buffered version held its K updates (the watchdog applies a
version left full); it was kept in rounds.deadline, which for synchronous rounds means
the round's deadline. Rows of buffered versions (their ``planned`` names a
``buffer``) move their value over. rounds.chord_id: never written since the chord
body stopped being read (fedq/coordinator/finalize.py reads results by task id).

On SQLite, batch mode copies the table: it is recreated with AUTOINCREMENT, as 0001
made it, so a deleted round's id (its task generation) is never handed out again.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_ROUNDS = {"sqlite_autoincrement": True}


def upgrade() -> None:
    with op.batch_alter_table("rounds", table_kwargs=_ROUNDS) as batch:
        batch.add_column(sa.Column("full_since", sa.DateTime(timezone=True), nullable=True))
        batch.drop_column("chord_id")
    rounds = sa.table("rounds", sa.column("id", sa.Integer), sa.column("planned", sa.JSON),
                      sa.column("deadline", sa.DateTime(timezone=True)),
                      sa.column("full_since", sa.DateTime(timezone=True)))
    bind = op.get_bind()
    versions = [i for i, planned in bind.execute(sa.select(rounds.c.id, rounds.c.planned))
                if isinstance(planned, dict) and "buffer" in planned]
    if versions:
        bind.execute(rounds.update().where(rounds.c.id.in_(versions))
                     .values(full_since=rounds.c.deadline, deadline=None))


def downgrade() -> None:
    rounds = sa.table("rounds", sa.column("deadline", sa.DateTime(timezone=True)),
                      sa.column("full_since", sa.DateTime(timezone=True)))
    op.get_bind().execute(rounds.update().where(rounds.c.full_since.isnot(None))
                          .values(deadline=rounds.c.full_since))
    with op.batch_alter_table("rounds", table_kwargs=_ROUNDS) as batch:
        batch.add_column(sa.Column("chord_id", sa.String(64), nullable=True))
        batch.drop_column("full_since")
