"""The ``batchinfer`` command line.

    batchinfer model prepare          convert/locate the served model (prints its folder)
    batchinfer db upgrade             apply the database migrations
    batchinfer api                    the HTTP API (uvicorn, ``api.main:create_app``)
    batchinfer worker [--model NAME]  a Celery worker serving one configured model (default: the first;
                                      solo pool: one engine per process)
    batchinfer beat                   Celery beat + a light worker for its ticks (scheduled runs; no engine)
    batchinfer serve                  db upgrade, then API + one worker per configured model (+ beat) as
                                      child processes (a worker or beat that dies is restarted; says when
                                      each worker is ready; /metrics carries the workers' engine metrics)
    batchinfer submit FILE [--endpoint URL] [--wait] [--output PATH]
    batchinfer status BATCH_ID        one batch's status, counts, tokens and files (and, while it waits
                                      for workers, whether one is ready)
    batchinfer ls [--limit N]         the latest batches
    batchinfer keys create [--name N] a new API key (printed once; stored hashed)
    batchinfer keys ls                every API key (id, name, first characters, created, revoked)
    batchinfer keys revoke KEY_ID     revoke a key
    batchinfer eval create|run|ls|show evals over the HTTP API (`worker.cli_evals`)
    batchinfer heads train             train EAGLE or Medusa draft heads on the model's own outputs (`worker.cli_heads`)

Everything is configured by ``BATCHINFER_*`` environment variables (`jobs.config.Settings`);
``submit``, ``status`` and ``ls`` send ``BATCHINFER_API_KEY`` (else ``OPENAI_API_KEY``) as the
bearer key when one is set, and ``keys`` works on the database directly. Heavy
imports (torch, the API app) happen inside the command that needs them, so this module imports
nothing of ``api`` and starts fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.config import get_settings, model_list

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)
TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
_SHUTDOWN_GRACE_S = 30
LIST_PAGE_MAX = 100  # the most GET /v1/batches returns per page (docs/api.md)
CONFIG_REFUSED_EXIT = 2
"""The exit status of a command whose configuration is refused: an invalid ``BATCHINFER_*`` setting, a worker's model
of a kind not served, an engine that refused its settings at load. Deterministic: ``serve`` does not restart a child
that exits with it (the same settings would fail the same way)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``batchinfer`` console script; returns the exit status (`CONFIG_REFUSED_EXIT` when a
    ``BATCHINFER_*`` setting is invalid, with one line per problem naming it)."""
    from pydantic import ValidationError

    try:
        get_settings()
    except ValidationError as exc:
        model_names = _model_entry_names()
        for error in exc.errors():
            print(f"batchinfer: {_setting_error(error, model_names)}", file=sys.stderr)
        return CONFIG_REFUSED_EXIT
    args = _parser().parse_args(argv)
    return args.handler(args) or 0


def _setting_error(error: Mapping[str, Any], model_names: Sequence[str | None] = ()) -> str:
    """One line naming the ``BATCHINFER_*`` variable, the place inside it (a model list's entry and key; the
    entry's model, by ``model_names``, where it has a name) and what was wrong with the value given."""
    if not error["loc"]:  # a check across settings (worker_dead_s against worker_heartbeat_s, ...)
        return f"settings: {error['msg']}"
    setting, *place = error["loc"]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in place)
    if setting == "models" and place and isinstance(place[0], int) and place[0] < len(model_names):
        name = model_names[place[0]]
        where += f" (model {name!r})" if name is not None else ""
    message = str(error["msg"]).removeprefix("Value error, ")  # pydantic's wrapper of a validator's ValueError
    return f"BATCHINFER_{str(setting).upper()}{where}: {message} (got {error.get('input')!r})"


def _model_entry_names() -> list[str | None]:
    """The model each entry of ``BATCHINFER_MODELS`` names (its ``name``, else its first alias; None for neither),
    in order, as pydantic numbers them in its errors; empty when the variable is unset or not a JSON list."""
    raw = next((value for key, value in os.environ.items() if key.upper() == "BATCHINFER_MODELS"), "")
    try:
        entries = model_list(raw)
    except ValueError:  # not JSON: its error names no entry
        return []
    if not isinstance(entries, list):
        return []
    names: list[str | None] = []
    for entry in entries:
        given = entry if isinstance(entry, dict) else {}
        aliases = given.get("aliases")
        candidates = [given.get("name"), *(aliases if isinstance(aliases, list) else [])]
        names.append(next((name for name in candidates if isinstance(name, str) and name), None))
    return names


def _parser() -> argparse.ArgumentParser:
    settings = get_settings()
    parser = argparse.ArgumentParser(prog="batchinfer", description="Batch LLM inference (OpenAI Batch API).")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    model = commands.add_parser("model", help="model management").add_subparsers(required=True, metavar="ACTION")
    prepare = model.add_parser("prepare", help="convert (once) and print the served model's folder")
    prepare.add_argument("--model", default=settings.model, help="built-in name or local HF folder")
    prepare.set_defaults(handler=_model_prepare)

    db = commands.add_parser("db", help="database management").add_subparsers(required=True, metavar="ACTION")
    db.add_parser("upgrade", help="apply migrations (alembic upgrade head)").set_defaults(handler=_db_upgrade)

    api = commands.add_parser("api", help="run the HTTP API")
    _add_bind_args(api, settings.api_host, settings.api_port)
    api.set_defaults(handler=_api)

    worker = commands.add_parser("worker", help="run a Celery worker (solo pool) serving one model")
    worker.add_argument(
        "--model",
        default=settings.served_model_name,
        help="the configured model to serve, by name or alias (BATCHINFER_MODELS; default: the first)",
    )
    worker.add_argument("--loglevel", default="INFO")
    worker.set_defaults(handler=_worker)

    beat = commands.add_parser("beat", help="run Celery beat (scheduled evaluation runs)")
    beat.add_argument("--loglevel", default="INFO")
    beat.set_defaults(handler=_beat)

    serve = commands.add_parser("serve", help="db upgrade, then API, worker and beat in child processes")
    _add_bind_args(serve, settings.api_host, settings.api_port)
    serve.add_argument("--no-beat", action="store_true", help="do not run the beat scheduler")
    serve.set_defaults(handler=_serve)

    submit = commands.add_parser("submit", help="submit a JSONL file as a batch through the HTTP API")
    submit.add_argument("file", type=Path)
    submit.add_argument(
        "--endpoint",
        choices=["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"],
        help="the batch's endpoint (default: the `url` of the file's first line)",
    )
    _add_base_url_arg(submit, settings.api_host, settings.api_port)
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--wait", action="store_true", help="poll until the batch ends, then download")
    submit.add_argument("--output", type=Path, help="where to write the output file (implies --wait)")
    submit.add_argument("--errors", type=Path, help="where to write the error file (default: OUTPUT.errors.jsonl)")
    submit.add_argument("--poll-interval", type=float, default=2.0, help="seconds between status polls")
    submit.set_defaults(handler=_submit)

    status = commands.add_parser("status", help="show one batch")
    status.add_argument("batch_id")
    _add_base_url_arg(status, settings.api_host, settings.api_port)
    status.set_defaults(handler=_status)

    ls = commands.add_parser("ls", help="list the latest batches")
    ls.add_argument("--limit", type=_positive_int, default=20, help="how many (pages of 100 are fetched as needed)")
    _add_base_url_arg(ls, settings.api_host, settings.api_port)
    ls.set_defaults(handler=_ls)

    keys = commands.add_parser("keys", help="API keys (docs/api.md, 'API keys')").add_subparsers(
        required=True, metavar="ACTION"
    )
    create_key = keys.add_parser("create", help="create a key and print it (shown only this once)")
    create_key.add_argument("--name", default="", help="a label for people (e.g. who uses the key)")
    create_key.set_defaults(handler=_keys_create)
    keys.add_parser("ls", help="list the keys").set_defaults(handler=_keys_ls)
    revoke_key = keys.add_parser("revoke", help="revoke a key (its objects stay, reachable by no key)")
    revoke_key.add_argument("key_id")
    revoke_key.set_defaults(handler=_keys_revoke)

    from worker.cli_evals import add_eval_commands
    from worker.cli_heads import add_heads_commands

    add_eval_commands(commands, settings)
    add_heads_commands(commands, settings)
    return parser


def _add_base_url_arg(parser: argparse.ArgumentParser, host: str, port: int) -> None:
    parser.add_argument(
        "--base-url",
        default=f"http://{host}:{port}",
        help="the server, with or without the /v1 suffix the openai SDK's base_url carries",
    )


def _add_bind_args(parser: argparse.ArgumentParser, host: str, port: int) -> None:
    parser.add_argument("--host", default=host)
    parser.add_argument("--port", type=_port, default=port)


def _model_prepare(args: argparse.Namespace) -> int:
    from worker.model_prepare import prepare_model

    print(prepare_model(args.model, get_settings().model_cache_dir))
    return 0


def _keys_database_problem() -> str | None:
    """Why ``keys`` cannot use the configured database, or None. A SQLite file that does not exist is
    reported, not created (the default lives under ``BATCHINFER_DATA_DIR``, relative to the current
    directory); a database without the tables is reported by :func:`_keys_command`."""
    from sqlalchemy.engine import make_url

    url = make_url(get_settings().database_url)
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).exists():
        return (
            f"no database at {url.database}: run this where the service runs (its "
            f"BATCHINFER_DATA_DIR is relative to the current directory), or set BATCHINFER_DATA_DIR or "
            f"BATCHINFER_DATABASE_URL to the service's"
        )
    return None


def _keys_command(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run a ``keys`` handler only on a database that exists and has the tables; else say why (exit 1)."""

    def run(args: argparse.Namespace) -> int:
        from sqlalchemy.exc import OperationalError, ProgrammingError

        problem = _keys_database_problem()
        if problem is None:
            try:
                return handler(args)
            except (OperationalError, ProgrammingError) as exc:
                problem = (
                    f"the database at {get_settings().database_url} cannot hold API keys "
                    f"({exc.orig}); run `batchinfer db upgrade` against it first"
                )
        print(f"batchinfer: {problem}", file=sys.stderr)
        return 1

    return run


@_keys_command
def _keys_create(args: argparse.Namespace) -> int:
    from jobs.api_keys import create_key
    from jobs.db import session_scope

    try:
        with session_scope() as session:
            created = create_key(session, name=args.name)
    except ValueError as exc:
        print(f"batchinfer keys create: {exc}", file=sys.stderr)
        return 2
    print(f"created {created.key.id} {args.name!r}; the key, shown only now:", file=sys.stderr)
    print(created.secret)
    return 0


@_keys_command
def _keys_ls(args: argparse.Namespace) -> int:
    from jobs.api_keys import list_keys
    from jobs.db import session_scope

    with session_scope() as session:
        keys = list_keys(session)
    print("id\tname\tkey\tcreated_at\trevoked_at")
    for key in keys:
        revoked = "" if key.revoked_at is None else str(key.revoked_at)
        print(f"{key.id}\t{key.name}\t{key.key_prefix}...\t{key.created_at}\t{revoked}")
    return 0


@_keys_command
def _keys_revoke(args: argparse.Namespace) -> int:
    from jobs.api_keys import revoke_key
    from jobs.db import session_scope
    from jobs.errors import NotFound

    try:
        with session_scope() as session:
            key = revoke_key(session, key_id=args.key_id)
    except NotFound as exc:
        print(f"batchinfer: {exc}", file=sys.stderr)
        return 1
    print(f"revoked {key.id} at {key.revoked_at}")
    return 0


def _auth_headers() -> dict[str, str]:
    """The bearer header for ``BATCHINFER_API_KEY`` (else ``OPENAI_API_KEY``); none when neither is set."""
    key = os.environ.get("BATCHINFER_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _db_upgrade(args: argparse.Namespace) -> int:
    from jobs.db import upgrade_database

    upgrade_database()
    return 0


def _api(args: argparse.Namespace) -> int:
    import uvicorn

    settings = get_settings()
    # NOTE: import strings keep `api` out of this module's imports (worker code never imports api).
    uvicorn.run(
        "api.main:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        http="api.connections:HeaderTimeoutH11Protocol",
        limit_concurrency=settings.max_connections,
    )
    return 0


def _worker(args: argparse.Namespace) -> int:
    from worker.cpu_threads import use_bounded_wait

    # NOTE: first, before any import below loads torch (libgomp reads its wait policy once, when loaded).
    use_bounded_wait()
    from celery.signals import worker_ready
    from pydantic import ValidationError

    from jobs.queue import configure_celery
    from worker.bootstrap import KindNotServed, check_served_kind
    from worker.telemetry import engine_format, engine_kv_cache_size, start_heartbeat

    # NOTE: through the environment, so every get_settings() of this process is the model's view.
    os.environ["BATCHINFER_WORKER_MODEL"] = args.model
    get_settings.cache_clear()
    try:
        settings = get_settings()
        check_served_kind(settings)
    except (ValidationError, KindNotServed) as exc:
        problem = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        print(f"batchinfer worker: {problem}", file=sys.stderr)
        return CONFIG_REFUSED_EXIT
    configure_celery(settings)
    heartbeat = start_heartbeat(settings)  # first: the row says "starting" while the model loads
    stop_telemetry = heartbeat.stop
    try:
        from worker.bootstrap import get_engine
        from worker.tasks import celery_app
        from worker.telemetry import start_worker_telemetry

        try:
            engine = get_engine()  # start-up cost (and any model error) up front, not inside the first task
        except ValueError as exc:  # the engine refused its settings (bootstrap.get_engine): one line, no restart
            if args.loglevel.upper() == "DEBUG":
                traceback.print_exc()
            print(f"batchinfer worker: the engine refused its settings: {exc}", file=sys.stderr)
            return CONFIG_REFUSED_EXIT
        stop_telemetry = start_worker_telemetry(
            settings,
            heartbeat,
            device=engine.config.device,
            max_model_len=engine.max_model_len,
            kv_cache=engine_kv_cache_size(engine),
            engine_format=engine_format(engine),
        )
        worker_ready.connect(lambda **_: heartbeat.mark_ready(), weak=False)
        # NOTE: no mingle (a second's wait for other workers' replies at start; we use no revokes or
        # clock sync) and no gossip: a worker takes its work from the broker and the database alone.
        celery_app.worker_main(
            ["worker", "--pool=solo", "--without-mingle", "--without-gossip", f"--loglevel={args.loglevel}"]
        )
    finally:
        stop_telemetry()
    return 0


def _beat(args: argparse.Namespace) -> int:
    from jobs.queue import SCHEDULES_QUEUE, celery_app

    schedule_file = get_settings().data_dir / "celerybeat-schedule"
    schedule_file.parent.mkdir(parents=True, exist_ok=True)
    celery_app.worker_main(
        [
            "worker",
            "--beat",
            f"--schedule={schedule_file}",
            "-Q",
            SCHEDULES_QUEUE,
            "--pool=solo",
            f"--loglevel={args.loglevel}",
            "--hostname=beat@%h",
        ]
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from jobs.db import upgrade_database
    from worker.bootstrap import SERVED_KINDS

    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_database()
    metrics_dir = fresh_metrics_dir(settings.data_dir)
    own = [sys.executable, "-m", "worker.cli"]
    api_env = dict(os.environ, BATCHINFER_ENGINE_METRICS_DIR=str(metrics_dir))
    children = [
        _Child("api", own + ["api", "--host", args.host, "--port", str(args.port)], restartable=False, env=api_env)
    ]
    for entry in settings.models:
        if entry.kind not in SERVED_KINDS:
            print(
                f"batchinfer: no worker for model {entry.name} (kind {entry.kind} is not yet served)", file=sys.stderr
            )
            continue
        children.append(
            _Child(
                f"worker {entry.name}",
                own + ["worker", "--model", entry.name],
                restartable=True,
                env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)),
                metrics_dir=metrics_dir,
            )
        )
    if not args.no_beat:
        children.append(_Child("beat", own + ["beat"], restartable=True))
    print(
        f"batchinfer: API on http://{args.host}:{args.port}/v1, data in {settings.data_dir}",
        file=sys.stderr,
        flush=True,
    )
    stopping = False

    def _stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        return _supervise(
            children, lambda: stopping, api_address=(args.host, args.port), ready_watch=ReadyWatch(ready_children)
        )
    finally:
        _stop_children([child.process for child in children])


def fresh_metrics_dir(data_dir: Path) -> Path:
    """``data_dir/metrics``, emptied: the folder ``serve``'s workers write their multiprocess metrics files
    to and its API reads (`api.routes.metrics`); files of an earlier run would add to this run's counters."""
    import shutil

    metrics_dir = data_dir / "metrics"
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    return metrics_dir


class _Child:
    """One child process of ``serve``, started at once: its command, its process, its recent exits.

    Each child leads a process group of its own, so that what it started itself (beat's embedded
    scheduler process) is stopped with it: signalled by `_stop_children`, killed by `reap_group` when
    the child died without stopping it.

    A restartable child (the worker, beat) that exits while ``serve`` is not stopping is started again
    after a back-off (:data:`_RESTART_BACKOFF_S`, doubled for each earlier exit within
    :data:`_RESTART_WINDOW_S`); the :data:`_MAX_RESTARTS` + 1-th exit within the window stops ``serve``, and so
    does its first exit with `CONFIG_REFUSED_EXIT` (its settings are refused: a restart would fail the same way).
    """

    def __init__(
        self,
        name: str,
        command: list[str],
        *,
        restartable: bool,
        env: dict[str, str] | None = None,
        metrics_dir: Path | None = None,
    ) -> None:
        self.name = name
        self.command = command
        self.restartable = restartable
        self.env = env
        self.metrics_dir = metrics_dir
        self.restarts = 0
        self.restart_at: float | None = None
        self._exits: list[float] = []
        self.restart()

    def restart(self) -> None:
        """Start the child's process (again), leading a process group of its own."""
        self.process = subprocess.Popen(self.command, process_group=0, env=self.env)
        self.restart_at = None

    def reap_group(self) -> None:
        """SIGKILL what is left of the exited child's process group (a killed beat leaves its scheduler),
        and drop its live gauges from the metrics folder (a killed worker could not)."""
        _signal_group(self.process, signal.SIGKILL)
        if self.metrics_dir is not None:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(self.process.pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]

    def record_exit(self, now: float) -> int:
        """Note an unexpected exit at ``now``; return how many happened within the restart window."""
        self._exits = [t for t in self._exits if now - t < _RESTART_WINDOW_S] + [now]
        return len(self._exits)


_MAX_RESTARTS = 3
_RESTART_WINDOW_S = 300.0
_RESTART_BACKOFF_S = 1.0
_UVICORN_STARTUP_FAILURE = 3  # uvicorn's exit status when the server could not start (uvicorn.config)


class ReadyWatch:
    """Says once per worker process of ``serve`` when it is ready: ``batchinfer: worker ready (model M) in N s``.

    ``find_ready(pids)`` returns ``{pid: (model, ready_s)}`` for the processes among ``pids`` that are
    ready (`ready_children`: their heartbeat rows, `jobs.workers.ready_workers`); it is asked at most
    every ``interval_s`` seconds, and only while a running worker child has not been reported.
    """

    def __init__(
        self, find_ready: Callable[[list[int]], dict[int, tuple[str, float]]], *, interval_s: float = 1.0
    ) -> None:
        self._find_ready = find_ready
        self._interval_s = interval_s
        self._next_s = 0.0
        self._reported: set[int] = set()

    def poll(self, children: list[_Child], now: float) -> None:
        """Report the worker children that became ready (``now``: `time.monotonic` seconds)."""
        if now < self._next_s:
            return
        self._next_s = now + self._interval_s
        waiting = [
            child.process.pid
            for child in children
            if child.name.startswith("worker")
            and child.process.poll() is None
            and child.process.pid not in self._reported
        ]
        if not waiting:
            return
        try:
            ready = self._find_ready(waiting)
        except Exception as exc:  # NOTE: the database may not answer yet; the next poll asks again
            logger.debug("serve: could not read worker readiness: %s", exc)
            return
        for pid, (model, ready_s) in sorted(ready.items()):
            self._reported.add(pid)
            print(f"batchinfer: worker ready (model {model}) in {ready_s:.1f} s", file=sys.stderr, flush=True)


def ready_children(pids: list[int]) -> dict[int, tuple[str, float]]:
    """``{pid: (model, ready_s)}`` of the worker processes of this host among ``pids`` whose heartbeat row
    says they are ready (the settings' database)."""
    import socket

    from jobs.db import session_scope
    from jobs.workers import ready_workers

    with session_scope() as session:
        rows = ready_workers(session, host=socket.gethostname(), pids=pids)
        return {row.pid: (row.model, float(row.ready_s or 0.0)) for row in rows}


def _supervise(
    children: list[_Child],
    stopping: Callable[[], bool],
    api_address: tuple[str, int],
    ready_watch: ReadyWatch | None = None,
) -> int:
    """Watch the children until ``stopping()`` (then 0) or until one exits for good (then its status).

    An exited restartable child is started again (see `_Child`); any other exit, or a restartable
    child exiting too often, ends the watch with one line on stderr saying why. ``ready_watch`` says
    when each worker child is ready.
    """
    while not stopping():
        now = time.monotonic()
        if ready_watch is not None:
            ready_watch.poll(children, now)
        for child in children:
            returncode = child.process.poll()
            if returncode is None:
                continue
            if child.restart_at is None:
                child.reap_group()
                if not _schedule_restart(child, returncode, now, api_address):
                    return returncode if returncode > 0 else 1
            elif now >= child.restart_at:
                child.restart()
        time.sleep(0.2)
    return 0


def _schedule_restart(child: _Child, returncode: int, now: float, api_address: tuple[str, int]) -> bool:
    """Say on stderr that ``child`` exited with ``returncode`` and set when it starts again; False when
    it is not to be restarted (the API, a child whose settings are refused, or one exiting too often) and ``serve``
    must stop."""
    exited = f"batchinfer: {child.name} {_describe_exit(returncode)}"
    if not child.restartable:
        hint = _api_exit_hint(*api_address) if returncode == _UVICORN_STARTUP_FAILURE else ""
        print(f"{exited}; stopping{hint}", file=sys.stderr, flush=True)
        return False
    if returncode == CONFIG_REFUSED_EXIT:
        print(
            f"{exited}: its settings are refused (its log above says why), which a restart would not change; stopping",
            file=sys.stderr,
            flush=True,
        )
        return False
    recent = child.record_exit(now)
    if recent > _MAX_RESTARTS:
        print(
            f"{exited} ({recent} exits within {_RESTART_WINDOW_S:.0f} s); giving up on it and stopping "
            f"(its log above says why it exits)",
            file=sys.stderr,
            flush=True,
        )
        return False
    delay_s = _RESTART_BACKOFF_S * 2 ** (recent - 1)
    child.restarts += 1
    child.restart_at = now + delay_s
    print(
        f"{exited}; restarting it in {delay_s:g} s (restart {child.restarts})",
        file=sys.stderr,
        flush=True,
    )
    return True


def _describe_exit(returncode: int) -> str:
    """``exited with status 1``, or ``exited with status -9 (killed by SIGKILL)`` for a signal."""
    if returncode < 0:
        try:
            return f"exited with status {returncode} (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return f"exited with status {returncode}"


def _api_exit_hint(host: str, port: int) -> str:
    """Why the API may have failed to start: its address in use or unusable, as a ``: ...`` suffix."""
    import errno
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return (
                f": port {port} on {host} is in use (another `batchinfer serve`?); "
                f"pick another with --port or BATCHINFER_API_PORT"
            )
        return f": cannot listen on {host}:{port} ({exc.strerror or exc}); check --host/--port"
    return ": the API failed while starting (its log above says why)"


def _stop_children(children: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every child still running (warm shutdown), then SIGKILL whatever outlives the grace period;
    a child that leads its own process group is signalled with its group, and what of the group outlives
    it is killed."""
    for child in children:
        if child.poll() is None:
            _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + _SHUTDOWN_GRACE_S
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        _signal_group(child, signal.SIGKILL)
        child.wait()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send ``sig`` to ``process``'s process group when it leads one (``process_group=0``), else to it
    alone while it has not been reaped; nothing when neither exists any more."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        if process.returncode is None:
            process.send_signal(sig)


def _submit(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        print(f"submit: no such file: {args.file}", file=sys.stderr)
        return 2
    if args.endpoint is None:
        args.endpoint = first_line_url(args.file)
        if args.endpoint is None:
            print(f"submit: the first line of {args.file} names no url; give --endpoint", file=sys.stderr)
            return 2
    return _over_http("submit", args, _submit_file)


def first_line_url(path: Path) -> str | None:
    """The ``url`` of the first non-blank line of a batch input file, or None when it has none."""
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    return None
                return url if isinstance(url, str) else None
    return None


def _over_http(command: str, args: argparse.Namespace, run: Any) -> int:
    """``run(args)``, explaining an unreachable server instead of a traceback."""
    import httpx

    try:
        code: int = run(args)
    except httpx.TransportError as exc:
        print(
            f"{command}: cannot reach batchinfer at {args.base_url} ({exc}); is `batchinfer serve` running?",
            file=sys.stderr,
        )
        return 1
    return code


def _status(args: argparse.Namespace) -> int:
    def run(args: argparse.Namespace) -> int:
        import httpx

        from worker.cli_views import print_status

        with httpx.Client(base_url=server_root(args.base_url), headers=_auth_headers(), timeout=30) as client:
            batch = _json_or_exit(client.get(f"/v1/batches/{args.batch_id}"))
            workers = client.get("/v1/workers")
            print_status(batch, sys.stdout, None if workers.is_error else workers.json()["data"])
        return 0

    return _over_http("status", args, run)


def _ls(args: argparse.Namespace) -> int:
    def run(args: argparse.Namespace) -> int:
        import httpx

        from worker.cli_views import print_batches

        batches: list[dict[str, Any]] = []
        with httpx.Client(base_url=server_root(args.base_url), headers=_auth_headers(), timeout=30) as client:
            params: dict[str, str | int] = {}
            while len(batches) < args.limit:
                params["limit"] = min(LIST_PAGE_MAX, args.limit - len(batches))
                page = _json_or_exit(client.get("/v1/batches", params=params))
                batches += page["data"]
                if not page["has_more"]:
                    break
                params["after"] = page["last_id"]
        print_batches(batches, sys.stdout)
        return 0

    return _over_http("ls", args, run)


def _submit_file(args: argparse.Namespace) -> int:
    import httpx

    metadata = dict(_key_value(item) for item in args.metadata)
    with httpx.Client(base_url=server_root(args.base_url), headers=_auth_headers(), timeout=120) as client:
        with args.file.open("rb") as f:
            data = {"endpoint": args.endpoint}
            if metadata:
                data["metadata"] = json.dumps(metadata)
            response = client.post("/v1/jobs", files={"file": (args.file.name, f, "application/jsonl")}, data=data)
        batch = _json_or_exit(response)
        print(f"batch {batch['id']}: {batch['status']}", file=sys.stderr, flush=True)
        if not (args.wait or args.output):
            print(json.dumps(batch, indent=2))
            return 0
        batch = _wait(client, batch, args.poll_interval)
        output = args.output or Path(f"{batch['id']}_output.jsonl")
        errors = args.errors or output.with_name(output.stem + ".errors.jsonl")
        _download(client, batch.get("output_file_id"), output)
        _download(client, batch.get("error_file_id"), errors)
    print(json.dumps(batch, indent=2))
    return 0 if batch["status"] == "completed" else 1


def server_root(base_url: str) -> str:
    """``base_url`` without a trailing ``/v1`` (or ``/``): the routes below are requested as ``/v1/...``."""
    return base_url.rstrip("/").removesuffix("/v1")


def _wait(client: httpx.Client, batch: dict[str, Any], poll_interval_s: float) -> dict[str, Any]:
    """Poll until the batch ends, showing progress on stderr (`worker.cli_views.ProgressView`)."""
    from worker.cli_views import ProgressView

    with ProgressView(sys.stderr) as view:
        view.update(batch)
        while batch["status"] not in TERMINAL_STATUSES:
            time.sleep(poll_interval_s)
            batch = _json_or_exit(client.get(f"/v1/batches/{batch['id']}"))
            view.update(batch)
    view.summary(batch)
    return batch


def _download(client: httpx.Client, file_id: str | None, path: Path) -> None:
    if not file_id:
        return
    response = client.get(f"/v1/files/{file_id}/content")
    response.raise_for_status()
    path.write_bytes(response.content)
    print(f"wrote {path}", file=sys.stderr)


def _json_or_exit(response: httpx.Response) -> dict[str, Any]:
    if response.is_error:
        raise SystemExit(f"batchinfer: HTTP {response.status_code}: {response.text}")
    body: dict[str, Any] = response.json()
    return body


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _port(text: str) -> int:
    value = _whole_number(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"batchinfer: --metadata expects KEY=VALUE, got {item!r}")
    return key, value


if __name__ == "__main__":
    sys.exit(main())
