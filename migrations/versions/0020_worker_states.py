"""A registered worker's state moves only forward, whoever writes the row.

``invited`` -> ``active`` (a join: a key set), ``invited``/``active`` -> ``revoked``,
and nothing back: a revoked name never comes back, an active worker's key never
changes, a new row is an invitation without a key. A trigger refuses anything else
(SQLSTATE 42501, "permission denied"), so a role that may write the table for
``fedq worker add`` and ``revoke`` (the submitter's, fedq/db/roles.py) cannot
re-activate a revoked worker, take over an active one's name or register a key. On
PostgreSQL only: the embedded default's SQLite file is its one user's.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-02
"""
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

FUNCTION = """
CREATE OR REPLACE FUNCTION fedq_worker_state() RETURNS trigger AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.state <> 'invited' OR NEW.public_key IS NOT NULL THEN
      RAISE EXCEPTION 'permission denied: a registered worker starts invited, without a key'
        USING ERRCODE = 'insufficient_privilege';
    END IF;
  ELSIF OLD.state = 'revoked' AND (NEW.state <> 'revoked'
        OR NEW.public_key IS DISTINCT FROM OLD.public_key
        OR NEW.token_sha256 IS NOT NULL) THEN
    RAISE EXCEPTION 'permission denied: worker % is revoked for good', OLD.name
      USING ERRCODE = 'insufficient_privilege';
  ELSIF OLD.state = 'active' AND (NEW.state NOT IN ('active', 'revoked')
        OR NEW.public_key IS DISTINCT FROM OLD.public_key) THEN
    RAISE EXCEPTION 'permission denied: worker % is active: it can only be revoked', OLD.name
      USING ERRCODE = 'insufficient_privilege';
  ELSIF OLD.state = 'invited' AND NEW.state = 'active' AND NEW.public_key IS NULL THEN
    RAISE EXCEPTION 'permission denied: worker % joins with a key', OLD.name
      USING ERRCODE = 'insufficient_privilege';
  ELSIF NEW.name <> OLD.name THEN
    RAISE EXCEPTION 'permission denied: a registered worker keeps its name'
      USING ERRCODE = 'insufficient_privilege';
  END IF;
  RETURN NEW;
END
$$ LANGUAGE plpgsql
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(FUNCTION)
    op.execute("DROP TRIGGER IF EXISTS fedq_worker_state ON registered_workers")
    op.execute("CREATE TRIGGER fedq_worker_state BEFORE INSERT OR UPDATE ON registered_workers "
               "FOR EACH ROW EXECUTE FUNCTION fedq_worker_state()")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS fedq_worker_state ON registered_workers")
    op.execute("DROP FUNCTION IF EXISTS fedq_worker_state()")
