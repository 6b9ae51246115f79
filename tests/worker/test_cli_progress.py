"""``batchinfer submit --wait`` in a pseudo-terminal (a live bar, then the summary) and piped (plain lines);
``status`` and ``ls``. The API runs in a thread; a stand-in worker thread runs the batch step by step."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys
import threading
import time

import pytest

from jobs.config import get_settings
from tests.helpers.service import completion_line, jsonl, queued_tasks
from tests.helpers.stand_in_engine import StandInEngine
from tests.worker.test_cli import data_dir, live_api  # noqa: F401  (fixtures)
from worker import runner
from worker.cli_views import ProgressView
from worker.metrics import EngineMetrics
from worker.telemetry import WorkerActivity, WorkerTelemetry

NUM_LINES = 8


@pytest.fixture
def stand_in_worker(live_api, served_tokenizer):
    """Runs every queued batch with a slow stand-in engine (50 ms a step, 2 lines at a time)."""
    stop = threading.Event()
    telemetry = WorkerTelemetry(EngineMetrics("m"), WorkerActivity())

    def work() -> None:
        while not stop.is_set():
            for _message in queued_tasks(get_settings().broker_url):
                engine = StandInEngine(served_tokenizer, max_num_seqs=2, on_step=lambda _: time.sleep(0.05))
                runner.run_next_shard(engine=engine, commit_every=1, observer=telemetry)
            stop.wait(0.2)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    yield live_api
    stop.set()
    thread.join(timeout=30)


def _job(tmp_path):
    path = tmp_path / "job.jsonl"
    path.write_bytes(jsonl([completion_line(f"c{i}", f"def f{i}(x):", max_tokens=6) for i in range(NUM_LINES)]))
    return path


def _submit_argv(path, base_url, tmp_path):
    return [
        sys.executable, "-m", "worker.cli", "submit", str(path), "--endpoint", "/v1/completions",
        "--base-url", base_url, "--poll-interval", "0.1", "--output", str(tmp_path / "out.jsonl"),
    ]  # fmt: skip


def _env(data_dir):
    env = dict(os.environ, BATCHINFER_DATA_DIR=str(data_dir), TERM="xterm-256color", COLUMNS="160")
    env.pop("NO_COLOR", None)
    return env


def test_submit_in_a_terminal_draws_a_bar_and_ends_with_the_summary(stand_in_worker, data_dir, tmp_path):
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        _submit_argv(_job(tmp_path), stand_in_worker, tmp_path),
        stdin=secondary, stdout=secondary, stderr=secondary, env=_env(data_dir), close_fds=True,
    )  # fmt: skip
    os.close(secondary)
    chunks = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([primary], [], [], 0.5)
        if ready:
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif process.poll() is not None:
            break
    os.close(primary)
    assert process.wait(timeout=30) == 0
    screen = b"".join(chunks).decode(errors="replace")

    assert "━" in screen and "\x1b[" in screen  # rich's bar, drawn with terminal control sequences
    assert "ETA" in screen and "lines/s" in screen and "tok/s" in screen
    assert f"{NUM_LINES}/0/{NUM_LINES} (completed/failed/total)" in screen
    assert f"completed, {NUM_LINES} completed, 0 failed of {NUM_LINES}" in screen  # the summary
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == NUM_LINES


def test_submit_piped_prints_plain_progress_lines(stand_in_worker, data_dir, tmp_path):
    result = subprocess.run(
        _submit_argv(_job(tmp_path), stand_in_worker, tmp_path),
        check=False, capture_output=True, text=True, env=_env(data_dir), timeout=120,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stderr and "━" not in result.stderr
    progress = [line for line in result.stderr.splitlines() if "(completed/failed/total)" in line]
    assert progress[-1].split(": ", 1)[1].startswith(f"completed {NUM_LINES}/0/{NUM_LINES}")
    assert len(progress) >= 2 and "lines/s" in progress[-1] and "ETA" in progress[-1]
    assert f"completed, {NUM_LINES} completed, 0 failed of {NUM_LINES}" in result.stderr  # the summary
    assert json.loads(result.stdout)["status"] == "completed"


def test_status_and_ls_piped(stand_in_worker, data_dir, tmp_path):
    submitted = subprocess.run(
        _submit_argv(_job(tmp_path), stand_in_worker, tmp_path), check=False, capture_output=True, text=True,
        env=_env(data_dir), timeout=120,
    )  # fmt: skip
    batch_id = json.loads(submitted.stdout)["id"]
    base = [sys.executable, "-m", "worker.cli"]

    status = subprocess.run(
        base + ["status", batch_id, "--base-url", stand_in_worker],
        check=False,
        capture_output=True,
        text=True,
        env=_env(data_dir),
    )
    listing = subprocess.run(
        base + ["ls", "--base-url", stand_in_worker + "/v1"],
        check=False,
        capture_output=True,
        text=True,
        env=_env(data_dir),
    )

    assert status.returncode == 0, status.stderr
    assert f"id: {batch_id}" in status.stdout and "status: completed" in status.stdout
    assert f"requests: {NUM_LINES} completed, 0 failed, {NUM_LINES} total" in status.stdout
    rows = [line.split("\t") for line in listing.stdout.splitlines()]
    assert rows[0][:5] == ["id", "status", "completed", "failed", "total"]
    assert rows[1][:5] == [batch_id, "completed", str(NUM_LINES), "0", str(NUM_LINES)]


def test_the_summary_of_a_batch_that_failed_validation_lists_its_errors():
    errors = [{"code": "invalid_url", "message": f"url {i} does not match", "line": i} for i in range(1, 8)]
    errors.append({"code": "empty_file", "message": "no requests", "line": None})
    batch = {"id": "batch_x", "status": "failed", "errors": {"object": "list", "data": errors}}
    stream = io.StringIO()
    text = ProgressView(stream).summary(batch)
    assert stream.getvalue() == text + "\n"
    lines = text.splitlines()
    assert lines[0].startswith("batch batch_x: failed")
    assert lines[1:6] == [f"  line {i}: invalid_url: url {i} does not match" for i in range(1, 6)]
    assert lines[6] == "  ... and 3 more (the batch's errors)"
    capped = {**batch, "errors": {"object": "list", "data": errors, "total": 4134}}  # data: the first 1,000
    assert ProgressView(io.StringIO()).summary(capped).splitlines()[6] == "  ... and 4129 more (the batch's errors)"


def test_rates_start_at_the_first_finished_line_not_while_the_worker_starts():
    now = [0.0]
    view = ProgressView(io.StringIO(), clock=lambda: now[0])

    def batch(done, tokens):
        counts = {"total": 100, "completed": done, "failed": 0}
        return {"id": "b", "status": "in_progress", "request_counts": counts, "usage": {"output_tokens": tokens}}

    assert view.rates(batch(0, 0)).eta_s is None
    now[0] = 40.0  # the worker took 40 s to load its model
    assert view.rates(batch(0, 0)).eta_s is None
    view.rates(batch(10, 100))  # the clock starts here, at 10 lines done
    now[0] = 50.0
    rates = view.rates(batch(30, 300))
    assert (rates.lines_per_s, rates.tokens_per_s, rates.eta_s) == (2.0, 20.0, 35.0)
