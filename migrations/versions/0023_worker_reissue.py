"""``fedq worker reissue``: the schema owner may send an active worker back to invited,
its key forgotten, under a new one-time token (a machine that lost its bundle or keys,
or whose bundle may have leaked); no other role may.

Everything else of migration 0020 holds: a revoked name never comes back, a key is set
only by a join (invited -> active, in the control worker), an active worker's key never
changes in place, a new row is an invitation without a key. The owner is the role that
owns ``registered_workers`` (the one that runs ``fedq db upgrade``), or a member of it;
the coordinator's and the submitter's roles (fedq/db/roles.py) are neither. On
PostgreSQL only.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07
"""
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

REISSUE = """
  ELSIF OLD.state = 'active' AND NEW.state = 'invited' AND NEW.public_key IS NULL
        AND NEW.token_sha256 IS NOT NULL AND NEW.name = OLD.name
        AND pg_has_role(current_user, (SELECT relowner FROM pg_class WHERE oid = TG_RELID),
                        'MEMBER') THEN
    RETURN NEW;  -- fedq worker reissue, by the schema's owner
"""


def _function(reissue: bool) -> str:
    return f"""
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
      USING ERRCODE = 'insufficient_privilege';{REISSUE if reissue else ""}
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
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_function(reissue=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_function(reissue=False))
