"""``batchinfer eval``: evals over the HTTP API (docs/api.md, "Evals").

    batchinfer eval create FILE              create an eval from a JSON or YAML file (the POST /v1/evals body)
    batchinfer eval run EVAL_ID FILE [--wait] start a run (FILE: the POST /v1/evals/{id}/runs body); --wait
                                             shows its progress bar until the run ends
    batchinfer eval ls [--limit N]           the latest evals
    batchinfer eval show EVAL_ID [RUN_ID]    an eval and its runs, or one run: its progress bar, counts and
                                             per-criterion results

Wired into `worker.cli` by `add_eval_commands`; talks to the API with the same key and base URL options.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from jobs.config import Settings

TERMINAL_RUN_STATUSES = frozenset({"completed", "failed", "canceled"})


def add_eval_commands(commands: Any, settings: Settings) -> None:
    """Add ``eval create|run|ls|show`` to the ``batchinfer`` sub-command parsers ``commands``."""
    from worker.cli import _add_base_url_arg, _positive_int

    actions = commands.add_parser("eval", help="evals (docs/api.md, 'Evals')").add_subparsers(
        required=True, metavar="ACTION"
    )
    create = actions.add_parser("create", help="create an eval from a JSON or YAML file")
    create.add_argument("file", type=Path)
    create.set_defaults(handler=_create)
    run = actions.add_parser("run", help="start a run of an eval (FILE: the runs-create body, JSON or YAML)")
    run.add_argument("eval_id")
    run.add_argument("file", type=Path)
    run.add_argument("--wait", action="store_true", help="show progress until the run ends")
    run.add_argument("--poll-interval", type=float, default=2.0, help="seconds between polls")
    run.set_defaults(handler=_run)
    ls = actions.add_parser("ls", help="list the latest evals")
    ls.add_argument("--limit", type=_positive_int, default=20)
    ls.set_defaults(handler=_ls)
    show = actions.add_parser("show", help="an eval and its runs, or one run")
    show.add_argument("eval_id")
    show.add_argument("run_id", nargs="?")
    show.set_defaults(handler=_show)
    for parser in (create, run, ls, show):
        _add_base_url_arg(parser, settings.api_host, settings.api_port)


def load_body(path: Path) -> dict[str, Any]:
    """A request body from a ``.json`` file, or YAML (``.yaml``/``.yml``, needs PyYAML).

    Raises:
        SystemExit: the file is missing, unreadable, not JSON/YAML (the parser's message, with the line), or
            not one object.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise SystemExit(f"batchinfer eval: cannot read {path}: {exc}") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise SystemExit("batchinfer eval: YAML files need PyYAML (pip install pyyaml)") from None
        try:
            body = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SystemExit(f"batchinfer eval: {path} is not YAML: {exc}") from None
    else:
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise SystemExit(f"batchinfer eval: {path} is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise SystemExit(f"batchinfer eval: {path} must hold one object")
    return body


def _client(args: argparse.Namespace) -> Any:
    import httpx

    from worker.cli import _auth_headers, server_root

    return httpx.Client(base_url=server_root(args.base_url), headers=_auth_headers(), timeout=120)


def _create(args: argparse.Namespace) -> int:
    from worker.cli import _json_or_exit, _over_http

    def run(args: argparse.Namespace) -> int:
        with _client(args) as client:
            print(json.dumps(_json_or_exit(client.post("/v1/evals", json=load_body(args.file))), indent=2))
        return 0

    return _over_http("eval create", args, run)


def _run(args: argparse.Namespace) -> int:
    from worker.cli import _json_or_exit, _over_http

    def run(args: argparse.Namespace) -> int:
        with _client(args) as client:
            created = _json_or_exit(client.post(f"/v1/evals/{args.eval_id}/runs", json=load_body(args.file)))
            print(f"run {created['id']}: {created['status']}", file=sys.stderr, flush=True)
            if not args.wait:
                print(json.dumps(created, indent=2))
                return 0
            done = _wait(client, created, args.poll_interval)
            print_run(done, sys.stdout)
        return 0 if done["status"] == "completed" else 1

    return _over_http("eval run", args, run)


def _wait(client: Any, run: dict[str, Any], poll_interval_s: float) -> dict[str, Any]:
    """Poll the run until it ends, its progress on stderr (`worker.cli_views.ProgressView`)."""
    from worker.cli import _json_or_exit
    from worker.cli_views import ProgressView

    path = f"/v1/evals/{run['eval_id']}/runs/{run['id']}"
    with ProgressView(sys.stderr, show_tokens=False) as view:
        view.update(as_progress(run))
        while run["status"] not in TERMINAL_RUN_STATUSES:
            time.sleep(poll_interval_s)
            run = _json_or_exit(client.get(path))
            view.update(as_progress(run))
    return run


def as_progress(run: dict[str, Any]) -> dict[str, Any]:
    """The run in the shape `worker.cli_views.ProgressView` draws (a batch object's fields): graded items
    are ``completed``, errored ones ``failed``. No token rate: items count once graded, after their shard's
    tokens were all generated, so a rate from the first graded item on would read 0 tok/s."""
    counts = run["result_counts"]
    status = {"queued": "validating", "canceled": "cancelled"}.get(run["status"], run["status"])
    return {
        "id": run["id"],
        "status": status,
        "created_at": run["created_at"],
        "request_counts": {
            "completed": counts["passed"] + counts["failed"],
            "failed": counts["errored"],
            "total": counts["total"],
        },
    }


def _ls(args: argparse.Namespace) -> int:
    from worker.cli import _json_or_exit, _over_http

    def run(args: argparse.Namespace) -> int:
        with _client(args) as client:
            page = _json_or_exit(client.get("/v1/evals", params={"limit": min(100, args.limit), "order": "desc"}))
        for row in page["data"]:
            names = ", ".join(criterion["name"] for criterion in row["testing_criteria"])
            print(f"{row['id']}  {row['name']}  criteria: {names}")
        return 0

    return _over_http("eval ls", args, run)


def _show(args: argparse.Namespace) -> int:
    from worker.cli import _json_or_exit, _over_http

    def run(args: argparse.Namespace) -> int:
        with _client(args) as client:
            if args.run_id is not None:
                from worker.cli_views import ProgressView

                run = _json_or_exit(client.get(f"/v1/evals/{args.eval_id}/runs/{args.run_id}"))
                with ProgressView(sys.stderr, show_tokens=False) as view:
                    view.update(as_progress(run))
                print_run(run, sys.stdout)
                return 0
            row = _json_or_exit(client.get(f"/v1/evals/{args.eval_id}"))
            runs = _json_or_exit(client.get(f"/v1/evals/{args.eval_id}/runs", params={"limit": 100}))["data"]
        print(f"{row['id']}  {row['name']}")
        for run in runs:
            print_run(run, sys.stdout)
        return 0

    return _over_http("eval show", args, run)


def print_run(run: dict[str, Any], stream: IO[str]) -> None:
    """One run: id, status, model, item counts, then each criterion's passed/failed and pass rate."""
    counts = run["result_counts"]
    stream.write(
        f"{run['id']}  {run['status']}  {run.get('model') or ''}  total {counts['total']}, passed {counts['passed']},"
        f" failed {counts['failed']}, errored {counts['errored']}\n"
    )
    for entry in run["per_testing_criteria_results"]:
        graded = entry["passed"] + entry["failed"]
        rate = f"{entry['passed'] / graded:.1%}" if graded else "-"
        stream.write(f"  {entry['testing_criteria']}: passed {entry['passed']}, failed {entry['failed']} ({rate})\n")
