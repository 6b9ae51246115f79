"""Engine and session factories, and programmatic Alembic migrations.

PostgreSQL in production, SQLite for the embedded default. SQLite connections get WAL journaling,
a 30 s busy timeout, foreign keys on, and ``BEGIN IMMEDIATE`` transactions (SQLAlchemy's documented
pysqlite recipe), because the API and the worker write to the same file from different processes:
SQLite transactions are serialized, so keep them short.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from jobs.config import get_settings

MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"
_SQLITE_BUSY_TIMEOUT_S = 30
POOL_SIZE, MAX_OVERFLOW = 10, 10
MAX_CONNECTIONS = POOL_SIZE + MAX_OVERFLOW
"""Connections one process's engine opens at most (kept: ``POOL_SIZE``); the API admits fewer requests at once."""
_lock = threading.Lock()
_READ_ONLY = "batchinfer_read_only"


def _resolve(url: str | None) -> str:
    return url or get_settings().database_url


_engines: dict[str, Engine] = {}
_sessionmakers: dict[str, sessionmaker[Session]] = {}


def _create_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, pool_size=POOL_SIZE, max_overflow=MAX_OVERFLOW)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        pool_size=POOL_SIZE,
        max_overflow=MAX_OVERFLOW,
        connect_args={"check_same_thread": False, "timeout": _SQLITE_BUSY_TIMEOUT_S},
    )

    @event.listens_for(engine, "connect")
    def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
        # NOTE: pysqlite's own implicit BEGIN is turned off so that "begin" below can say IMMEDIATE.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(connection: Connection) -> None:
        # NOTE: a deferred transaction that reads and then writes fails at once (SQLITE_BUSY) when
        # another process wrote in between; IMMEDIATE takes the write lock up front and waits for it.
        # A read-only transaction takes no lock: under WAL it reads a snapshot while a writer works.
        connection.exec_driver_sql("BEGIN" if is_read_only(connection) else "BEGIN IMMEDIATE")

    return engine


def get_engine(url: str | None = None, *, read_only: bool = False) -> Engine:
    """The process-wide engine for ``url`` (default: ``settings.database_url``), created once per URL.

    A SQLite file's parent directory is created if missing. ``read_only``: a view of that engine (same
    pool) whose transactions only read: on SQLite a deferred ``BEGIN``, which takes no write lock, so it
    neither waits for nor blocks a writer; on PostgreSQL ``READ ONLY``, where a write raises.
    """
    url = _resolve(url)
    with _lock:
        if url not in _engines:
            _engines[url] = _create_engine(url)
        engine = _engines[url]
    if not read_only:
        return engine
    if engine.dialect.name == "postgresql":
        return engine.execution_options(**{_READ_ONLY: True, "postgresql_readonly": True})
    return engine.execution_options(**{_READ_ONLY: True})


def is_read_only(connection: Connection) -> bool:
    """Whether ``connection`` came from `get_engine` with ``read_only`` (its transactions only read)."""
    return bool(connection.get_execution_options().get(_READ_ONLY, False))


def make_sessionmaker(url: str | None = None) -> sessionmaker[Session]:
    """A session factory bound to ``get_engine(url)``; objects stay readable after commit."""
    url = _resolve(url)
    engine = get_engine(url)
    with _lock:
        if url not in _sessionmakers:
            _sessionmakers[url] = sessionmaker(bind=engine, expire_on_commit=False)
        return _sessionmakers[url]


@contextmanager
def session_scope(url: str | None = None, *, read_only: bool = False) -> Iterator[Session]:
    """One transaction: commit when the block exits normally, roll back (and re-raise) on error.

    ``read_only``: for readers (the API's GETs), on `get_engine` with ``read_only``. On SQLite the
    transaction is a deferred ``BEGIN``, which takes no write lock, so it neither waits for nor blocks a
    writer (a grading task storing 20,000 grades); on PostgreSQL it is ``READ ONLY``. Either way it ends
    in a rollback: a write in it raises on PostgreSQL; on SQLite it takes the write lock after all (the
    wait a reader must avoid) and is then rolled back.
    """
    factory = make_sessionmaker(url)
    session = factory(bind=get_engine(url, read_only=True)) if read_only else factory()
    try:
        yield session
        if read_only:
            session.rollback()
        else:
            session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def dispose_engines() -> None:
    """Close every pooled connection and forget the cached engines (tests; before dropping a database)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
        _sessionmakers.clear()


def upgrade_database(url: str | None = None) -> None:
    """Run ``alembic upgrade head`` on ``url`` (default: ``settings.database_url``), from any cwd.

    Raises:
        sqlalchemy.exc.OperationalError: the database is unreachable.
    """
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["database_url"] = _resolve(url)
    command.upgrade(config, "head")
