"""fedq's Alembic migrations; installed as ``fedq._migrations`` (see setup.py)."""
