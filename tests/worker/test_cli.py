"""The ``batchinfer`` command line: argument parsing, ``db upgrade``, ``submit`` against a live API."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import inspect

from jobs.config import BUILTIN_MODEL, get_settings
from jobs.db import dispose_engines, get_engine
from worker import cli


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    for name in ("DATABASE_URL", "BROKER_URL", "FILES_DIR", "RESULT_BACKEND"):
        monkeypatch.delenv(f"BATCHINFER_{name}", raising=False)
    get_settings.cache_clear()
    yield tmp_path / "data"
    dispose_engines()
    get_settings.cache_clear()


@pytest.mark.parametrize(
    "argv",
    [
        ["model", "prepare"],
        ["db", "upgrade"],
        ["api", "--port", "9001"],
        ["beat"],
        ["serve", "--no-beat"],
        ["submit", "jobs.jsonl", "--endpoint", "/v1/completions", "--wait", "--metadata", "a=b"],
        ["status", "batch_x", "--base-url", "http://h:1/v1"],
        ["ls", "--limit", "5"],
    ],
)
def test_every_command_parses(argv):
    args = cli._parser().parse_args(argv)
    assert callable(args.handler)


@pytest.mark.parametrize(
    ("variable", "value", "named", "given"),
    [
        ("BATCHINFER_API_PORT", "abc", "BATCHINFER_API_PORT: ", "'abc'"),
        ("BATCHINFER_API_PORT", "99999", "BATCHINFER_API_PORT: ", "99999"),
        ("BATCHINFER_KV_CACHE_DTYPE", "int2", "BATCHINFER_KV_CACHE_DTYPE: ", "'int2'"),
        (
            "BATCHINFER_MODELS",
            '{"a": {"source": "x", "kv_cache_dtyp": "int8"}}',
            "BATCHINFER_MODELS[0].kv_cache_dtyp (model 'a'): ",
            "'int8'",
        ),
        (  # the entry named by its model, not only its index
            "BATCHINFER_MODELS",
            '[{"name": "a", "source": "x"}, {"name": "e", "source": "y", "kind": "embed", "kv_cache_dtype": "int8"}]',
            "BATCHINFER_MODELS[1] (model 'e'): kv_cache_dtype is a generate model's",
            "'int8'",
        ),
        (  # without a name (refused), by its first alias
            "BATCHINFER_MODELS",
            '[{"source": "x", "aliases": ["b"]}]',
            "BATCHINFER_MODELS[0].name (model 'b'): Field required",
            "'source': 'x'",
        ),
        ("BATCHINFER_MODELS", '[{"source": "x"}]', "BATCHINFER_MODELS[0].name: Field required", "'source': 'x'"),
    ],
)
def test_an_invalid_setting_is_one_line_naming_it(monkeypatch, capsys, variable, value, named, given):
    monkeypatch.setenv(variable, value)
    get_settings.cache_clear()
    try:
        assert cli.main(["ls"]) == 2
    finally:
        monkeypatch.delenv(variable)
        get_settings.cache_clear()
    err = capsys.readouterr().err
    assert err.startswith("batchinfer: " + named) and err.count(given) == 1, err  # the value given, said once
    assert "Traceback" not in err and "Value error" not in err and len(err.splitlines()) == 1


def test_a_port_out_of_range_is_refused_at_parsing(capsys):
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--port", "99999"])
    assert "a TCP port is 1..65535, got 99999" in capsys.readouterr().err


def test_submit_rejects_an_unknown_endpoint(capsys):
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["submit", "f.jsonl", "--endpoint", "/v1/moderations"])
    assert "invalid choice" in capsys.readouterr().err


def test_db_upgrade_creates_the_schema(data_dir):
    assert cli.main(["db", "upgrade"]) == 0
    tables = set(inspect(get_engine()).get_table_names())
    assert {"files", "batches", "batch_requests"} <= tables
    assert (data_dir / "batchinfer.db").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_api(data_dir):
    """The real API app under uvicorn in a thread, on the embedded defaults in ``data_dir``."""
    import uvicorn

    from api.main import create_app

    cli.main(["db", "upgrade"])
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(get_settings()), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_submit_posts_the_file_and_prints_the_batch(live_api, tmp_path, capsys, suffix):
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": BUILTIN_MODEL, "prompt": "Hello", "max_tokens": 2},
    }
    path = tmp_path / "job.jsonl"
    path.write_text(json.dumps(line) + "\n")

    code = cli.main(
        [
            "submit",
            str(path),
            "--endpoint",
            "/v1/completions",
            "--base-url",
            live_api + suffix,
            "--metadata",
            "team=evals",
        ]
    )

    assert code == 0
    batch = json.loads(capsys.readouterr().out)
    assert batch["object"] == "batch" and batch["id"].startswith("batch_")
    assert batch["endpoint"] == "/v1/completions" and batch["metadata"] == {"team": "evals"}
    assert batch["status"] in ("validating", "in_progress")


def test_submit_takes_the_endpoint_from_the_first_line(live_api, tmp_path, capsys):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": BUILTIN_MODEL}}
    path = tmp_path / "job.jsonl"
    path.write_text("\n" + json.dumps(line) + "\n")

    assert cli.main(["submit", str(path), "--base-url", live_api]) == 0
    assert json.loads(capsys.readouterr().out)["endpoint"] == "/v1/chat/completions"

    path.write_text("not json\n")
    assert cli.main(["submit", str(path), "--base-url", live_api]) == 2
    assert "give --endpoint" in capsys.readouterr().err


def test_submit_reports_http_errors(live_api, tmp_path):
    path = tmp_path / "job.jsonl"
    path.write_text("{}\n")
    with pytest.raises(SystemExit, match="HTTP 4"):
        cli.main(
            [
                "submit",
                str(path),
                "--endpoint",
                "/v1/completions",
                "--base-url",
                live_api,
                "--metadata",
                "x=" + "v" * 600,
            ]
        )


def test_ls_pages_past_the_api_limit(live_api, tmp_path, capsys, monkeypatch):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": BUILTIN_MODEL}}
    path = tmp_path / "job.jsonl"
    path.write_text(json.dumps(line) + "\n")
    for _ in range(3):
        assert cli.main(["submit", str(path), "--base-url", live_api]) == 0
    capsys.readouterr()
    monkeypatch.setattr(cli, "LIST_PAGE_MAX", 2)  # three batches take two pages
    assert cli.main(["ls", "--limit", "1000", "--base-url", live_api]) == 0
    out = capsys.readouterr().out
    assert out.count("batch_") == 3
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["ls", "--limit", "0"])
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["ls", "--limit", "abc"])
    assert "argument --limit: must be a whole number, got 'abc'" in capsys.readouterr().err


def test_stop_children_terminates_then_kills(monkeypatch):
    ignores_term = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)",
    ]
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = subprocess.Popen(ignores_term, stdout=subprocess.PIPE)
    stubborn.stdout.readline()
    monkeypatch.setattr(cli, "_SHUTDOWN_GRACE_S", 1)
    started = time.monotonic()
    cli._stop_children([polite, stubborn])
    assert polite.returncode is not None and stubborn.returncode == -9
    assert time.monotonic() - started < 10


def test_cli_imports_neither_torch_nor_api():
    code = "import sys, worker.cli; print(sorted(m for m in ('torch', 'api', 'api.main') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_submit_explains_a_missing_file_and_an_unreachable_server(tmp_path, capsys):
    code = cli.main(["submit", str(tmp_path / "nope.jsonl"), "--endpoint", "/v1/completions"])
    assert code == 2 and "no such file" in capsys.readouterr().err

    path = tmp_path / "jobs.jsonl"
    path.write_text("{}\n")
    code = cli.main(["submit", str(path), "--endpoint", "/v1/completions", "--base-url", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 1 and "cannot reach batchinfer at http://127.0.0.1:1" in err and "Traceback" not in err


def test_keys_create_ls_revoke(data_dir, capsys):
    """``batchinfer keys``: the secret is printed once, listed by its first characters, then revoked."""
    from jobs.api_keys import find_key
    from jobs.db import session_scope

    assert cli.main(["db", "upgrade"]) == 0
    assert cli.main(["keys", "create", "--name", "ci"]) == 0
    secret = capsys.readouterr().out.strip()
    assert secret.startswith("bi-")
    assert cli.main(["keys", "ls"]) == 0
    _header, row = capsys.readouterr().out.rstrip("\n").splitlines()
    key_id, name, shown, _created, revoked = row.split("\t")
    assert (name, revoked) == ("ci", "") and secret.startswith(shown.removesuffix("...")) and shown != secret
    with session_scope() as session:
        assert find_key(session, secret=secret) is not None
    assert cli.main(["keys", "revoke", key_id]) == 0
    with session_scope() as session:
        assert find_key(session, secret=secret) is None
    assert cli.main(["keys", "revoke", "key_nope"]) == 1
    # A name that is not UTF-8 on the command line reaches Python as a lone surrogate (surrogateescape).
    assert cli.main(["keys", "create", "--name", "caf\udce9"]) == 2
    assert "lone surrogate" in capsys.readouterr().err


def test_keys_say_where_the_database_is_missing_instead_of_a_traceback(data_dir, capsys):
    """``batchinfer keys`` away from the service's data directory: no traceback, no empty database left behind;
    on a database without the tables, a hint to upgrade it."""
    assert cli.main(["keys", "ls"]) == 1
    err = capsys.readouterr().err
    assert "no database at" in err and "BATCHINFER_DATA_DIR" in err and "Traceback" not in err
    assert not (data_dir / "batchinfer.db").exists()
    data_dir.mkdir(parents=True)
    (data_dir / "batchinfer.db").touch()  # a database file without the tables
    assert cli.main(["keys", "create", "--name", "x"]) == 1
    assert "batchinfer db upgrade" in capsys.readouterr().err


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.fixture
def quick_restarts(monkeypatch):
    monkeypatch.setattr(cli, "_RESTART_BACKOFF_S", 0.05)


def test_serve_restarts_a_killed_worker_and_keeps_the_api(quick_restarts, capsys):
    api = cli._Child("api", _python("import time; time.sleep(60)"), restartable=False)
    worker = cli._Child("worker", _python("import time; time.sleep(60)"), restartable=True)
    first_worker = worker.process
    stop = threading.Event()
    result = []
    watcher = threading.Thread(target=lambda: result.append(cli._supervise([api, worker], stop.is_set, ("h", 1))))
    watcher.start()
    try:
        first_worker.kill()
        deadline = time.monotonic() + 10
        while worker.process is first_worker and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.process is not first_worker and worker.process.poll() is None
        assert api.process.poll() is None
    finally:
        stop.set()
        watcher.join()
        cli._stop_children([api.process, worker.process])
    assert result == [0]
    assert capsys.readouterr().err == (
        "batchinfer: worker exited with status -9 (killed by SIGKILL); restarting it in 0.05 s (restart 1)\n"
    )


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _with_grandchild() -> list[str]:
    """A child that starts a process of its own, as beat starts its scheduler."""
    return _python(
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )


def test_serve_kills_what_a_dead_child_started_and_what_a_stopped_child_leaves(quick_restarts, capsys):
    beat = cli._Child("beat", _with_grandchild(), restartable=True)
    grandchild = _find_grandchild(beat.process.pid)
    beat.process.kill()
    beat.process.wait()
    assert _pid_alive(grandchild)  # orphaned, it would go on (beat's scheduler sends work) ...
    beat.reap_group()  # ... until serve kills what is left of the dead child's group
    deadline = time.monotonic() + 5
    while _pid_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(grandchild)

    worker = cli._Child("worker", _with_grandchild(), restartable=True)
    grandchild = _find_grandchild(worker.process.pid)
    cli._stop_children([worker.process])
    deadline = time.monotonic() + 5
    while _pid_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(grandchild)


def _find_grandchild(pid: int) -> int:
    """The first running process in process group ``pid`` other than ``pid`` itself."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != pid:
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == pid and fields[0] not in ("Z", "X"):
                    return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"no process in group {pid}")


def test_serve_gives_up_on_a_worker_that_exits_at_every_start(quick_restarts, capsys):
    api = cli._Child("api", _python("import time; time.sleep(60)"), restartable=False)
    worker = cli._Child("worker", _python("raise SystemExit(1)"), restartable=True)  # a crash, as an exception's
    try:
        assert cli._supervise([api, worker], lambda: False, ("h", 1)) == 1
    finally:
        cli._stop_children([api.process, worker.process])
    lines = capsys.readouterr().err.splitlines()
    assert [line.rsplit("(", 1)[1] for line in lines[:3]] == ["restart 1)", "restart 2)", "restart 3)"]
    assert "restarting it in 0.1 s" in lines[1] and "restarting it in 0.2 s" in lines[2]
    assert lines[3] == (
        "batchinfer: worker exited with status 1 (4 exits within 300 s); giving up on it and stopping "
        "(its log above says why it exits)"
    )
    assert len(lines) == 4


def test_serve_does_not_restart_a_worker_whose_settings_are_refused(quick_restarts, capsys):
    api = cli._Child("api", _python("import time; time.sleep(60)"), restartable=False)
    worker = cli._Child("worker", _python(f"raise SystemExit({cli.CONFIG_REFUSED_EXIT})"), restartable=True)
    first_worker = worker.process
    try:
        assert cli._supervise([api, worker], lambda: False, ("h", 1)) == cli.CONFIG_REFUSED_EXIT
    finally:
        cli._stop_children([api.process, worker.process])
    assert worker.process is first_worker and worker.restarts == 0
    assert capsys.readouterr().err == (
        "batchinfer: worker exited with status 2: its settings are refused (its log above says why), which a "
        "restart would not change; stopping\n"
    )


def test_worker_whose_engine_refuses_its_settings_says_why_in_one_line(tmp_path, served_model_dir):
    """float16 weights with quantization q4 are refused when the model loads (q4 runs float32 or bfloat16)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    env.update(BATCHINFER_DATA_DIR=str(tmp_path), BATCHINFER_DTYPE="float16", BATCHINFER_QUANTIZATION="q4")
    command = [sys.executable, "-m", "worker.cli"]
    subprocess.run([*command, "db", "upgrade"], env=env, check=True, capture_output=True, timeout=120)
    worker = subprocess.run([*command, "worker"], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert worker.returncode == cli.CONFIG_REFUSED_EXIT, worker.stderr[-2000:]
    assert worker.stderr.splitlines() == [
        "batchinfer worker: the engine refused its settings: quantization 'q4' runs float32 or bfloat16 models on "
        "CPU; model.embed_tokens.weight is torch.float16 on cpu"
    ]


def test_serve_says_which_port_is_taken_when_the_api_cannot_start(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        api = cli._Child("api", _python("raise SystemExit(3)"), restartable=False)
        worker = cli._Child("worker", _python("import time; time.sleep(60)"), restartable=True)
        try:
            assert cli._supervise([api, worker], lambda: False, ("127.0.0.1", port)) == 3
        finally:
            cli._stop_children([api.process, worker.process])
    assert capsys.readouterr().err == (
        f"batchinfer: api exited with status 3; stopping: port {port} on 127.0.0.1 is in use (another "
        f"`batchinfer serve`?); pick another with --port or BATCHINFER_API_PORT\n"
    )


def test_serve_stops_when_the_api_exits_after_starting(capsys):
    api = cli._Child("api", _python("raise SystemExit(1)"), restartable=False)
    assert cli._supervise([api], lambda: False, ("127.0.0.1", 1)) == 1
    assert capsys.readouterr().err == "batchinfer: api exited with status 1; stopping\n"


def _worker_row(pid: int, ready_s: float | None, host: str | None = None) -> None:
    from jobs.db import session_scope
    from jobs.status import now_s
    from jobs.workers import record_heartbeat

    host = host or socket.gethostname()
    with session_scope() as session:
        record_heartbeat(
            session,
            worker_id=f"{host}:{pid}",
            host=host,
            pid=pid,
            model=BUILTIN_MODEL,
            device="cpu",
            current_batch_id=None,
            num_running_requests=0,
            tokens_per_s=0.0,
            metrics_port=None,
            started_at=now_s(),
            now=now_s(),
            ready_s=ready_s,
        )


def test_status_says_when_no_worker_is_ready(live_api, tmp_path, capsys):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": BUILTIN_MODEL}}
    path = tmp_path / "job.jsonl"
    path.write_text(json.dumps({**line, "body": {**line["body"], "prompt": "Hi", "max_tokens": 2}}) + "\n")
    assert cli.main(["submit", str(path), "--base-url", live_api]) == 0
    batch_id = json.loads(capsys.readouterr().out)["id"]

    def status() -> str:
        assert cli.main(["status", batch_id, "--base-url", live_api]) == 0
        return capsys.readouterr().out

    assert f"workers: waiting: no worker serves model {BUILTIN_MODEL}\n" in status()
    _worker_row(4242, None)
    assert "workers: waiting: no worker is ready (1 starting)\n" in status()
    _worker_row(4242, 7.5)
    assert "workers: 1 ready\n" in status()


def test_serve_says_when_each_worker_is_ready(data_dir, capsys):
    """A stand-in worker child writes its heartbeat row as `batchinfer worker` does: starting, then ready."""
    cli.main(["db", "upgrade"])
    child_code = (
        "import os, time; from tests.worker.test_cli import _worker_row; "
        "_worker_row(os.getpid(), None); time.sleep(1.5); _worker_row(os.getpid(), 3.5); time.sleep(60)"
    )
    api = cli._Child("api", _python("import time; time.sleep(60)"), restartable=False)
    worker = cli._Child("worker", _python(child_code), restartable=True)
    _worker_row(worker.process.pid + 100000, 1.0, host="elsewhere")  # another host's ready worker: not ours
    watch = cli.ReadyWatch(cli.ready_children, interval_s=0.1)
    stop = threading.Event()
    watcher = threading.Thread(target=lambda: cli._supervise([api, worker], stop.is_set, ("h", 1), watch))
    watcher.start()
    err, deadline = "", time.monotonic() + 60
    try:
        while not err and time.monotonic() < deadline:
            time.sleep(0.1)
            err = capsys.readouterr().err
        time.sleep(0.5)  # polls go on: the worker is not reported twice
    finally:
        stop.set()
        watcher.join()
        cli._stop_children([api.process, worker.process])
    assert err + capsys.readouterr().err == f"batchinfer: worker ready (model {BUILTIN_MODEL}) in 3.5 s\n"


def test_eval_create_with_bad_yaml_says_where_without_a_traceback(tmp_path):
    eval_file = tmp_path / "eval.yaml"
    eval_file.write_text("name: broken\ntesting_criteria: [{type: string_check\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "create", str(eval_file), "--base-url", "http://127.0.0.1:9"])
    message = str(exit_info.value.code)
    assert message.startswith(f"batchinfer eval: {eval_file} is not YAML:") and "line 3" in message


def test_eval_run_wait_shows_graded_items_per_second_and_no_token_rate(capsys):
    """Items count once graded, after their shard's tokens were all generated: a tok/s figure read 0.0."""
    import httpx

    from worker.cli_evals import _wait

    def run(passed: int, status: str) -> dict[str, object]:
        return {
            "id": "evalrun_1",
            "eval_id": "eval_1",
            "status": status,
            "created_at": 0,
            "result_counts": {"total": 10, "passed": passed, "failed": 0, "errored": 0},
            "per_model_usage": [{"completion_tokens": 400}],
        }

    polls = iter([run(5, "in_progress"), run(10, "completed")])
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=next(polls)))
    with httpx.Client(transport=transport, base_url="http://api") as client:
        assert _wait(client, run(1, "in_progress"), 0.01)["status"] == "completed"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all("lines/s" in line and "tok/s" not in line for line in lines)


def test_eval_create_run_ls_and_show(live_api, tmp_path, capsys):
    item_schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    criterion = {
        "type": "string_check",
        "name": "exact",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": "eq",
    }
    eval_file = tmp_path / "eval.yaml"
    eval_file.write_text(
        "name: yes-no\n"
        f"data_source_config: {json.dumps({'type': 'custom', 'item_schema': item_schema})}\n"
        f"testing_criteria: [{json.dumps(criterion)}]\n"
    )
    assert cli.main(["eval", "create", str(eval_file), "--base-url", live_api]) == 0
    eval_id = json.loads(capsys.readouterr().out)["id"]
    content = [{"item": {"answer": "yes"}, "sample": {"output_text": "yes"}}]
    run_file = tmp_path / "run.json"
    run_file.write_text(
        json.dumps({"data_source": {"type": "jsonl", "source": {"type": "file_content", "content": content}}})
    )
    assert cli.main(["eval", "run", eval_id, str(run_file), "--base-url", live_api]) == 0
    run_id = json.loads(capsys.readouterr().out)["id"]
    assert cli.main(["eval", "ls", "--base-url", live_api]) == 0
    assert f"{eval_id}  yes-no  criteria: exact" in capsys.readouterr().out
    assert cli.main(["eval", "show", eval_id, run_id, "--base-url", live_api]) == 0
    out = capsys.readouterr().out
    assert out.startswith(run_id) and "total 1" in out and "exact: passed" in out
    assert cli.main(["eval", "show", eval_id, "--base-url", live_api]) == 0
    assert run_id in capsys.readouterr().out
