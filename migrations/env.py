"""Alembic environment: the database URL comes from `jobs.db.upgrade_database` or the settings.

Run through `jobs.db.upgrade_database(url)` (``batchinfer db upgrade``), which needs no
``alembic.ini``: it passes ``script_location`` and the URL programmatically.
"""

from __future__ import annotations

from alembic import context

from jobs.config import get_settings
from jobs.db import get_engine
from jobs.models import Base

config = context.config
database_url = config.attributes.get("database_url") or get_settings().database_url


def run_migrations_offline() -> None:
    """Emit the SQL for ``database_url`` without connecting (``alembic upgrade --sql``)."""
    context.configure(
        url=database_url,
        target_metadata=Base.metadata,
        literal_binds=True,
        render_as_batch=database_url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Migrate through the service's own engine (so SQLite gets the same pragmas as the app)."""
    with get_engine(database_url).connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
