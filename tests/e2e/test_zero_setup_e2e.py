"""The zero-setup default: ``batchinfer serve`` on SQLite + the embedded broker, a job via ``batchinfer submit``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import httpx
import pytest

from jobs.config import BUILTIN_EMBEDDING_MODEL, BUILTIN_MODEL
from tests.e2e.processes import ROOT, child_env, child_processes, cli, free_port, running, wait_for_health

pytestmark = pytest.mark.slow


def test_serve_and_submit_on_the_embedded_defaults(tmp_path, served_tokenizer):
    data_dir = tmp_path / "data"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = child_env(data_dir=str(data_dir))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    lines = [
        {
            "custom_id": "france",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": BUILTIN_MODEL, "messages": messages, "max_tokens": 12, "temperature": 0},
        },
        {
            "custom_id": "two-samples",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": BUILTIN_MODEL,
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 4,
                "n": 2,
                "seed": 3,
                "logprobs": True,
                "top_logprobs": 2,
            },
        },
    ]
    input_path = tmp_path / "job.jsonl"
    input_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output_path = tmp_path / "out.jsonl"
    serve_log = tmp_path / "serve.log"

    with running(cli("serve", "--host", "127.0.0.1", "--port", str(port)), env, serve_log) as serve:
        wait_for_health(base_url, serve, serve_log, timeout_s=180)
        submit = subprocess.run(  # noqa: PLW1510 (the exit code is asserted below)
            cli(
                "submit",
                str(input_path),
                "--endpoint",
                "/v1/chat/completions",
                "--base-url",
                base_url,
                "--output",
                str(output_path),
                "--poll-interval",
                "1",
                "--metadata",
                "suite=e2e",
            ),
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert submit.returncode == 0, f"{submit.stderr}\n--- serve log\n{serve_log.read_text()[-4000:]}"
        metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=60) == 0, serve_log.read_text()[-4000:]

    batch = json.loads(submit.stdout)
    assert batch["status"] == "completed" and batch["metadata"] == {"suite": "e2e"}
    # the worker's engine metrics, labelled by its model, through the API's /metrics with no port set
    label = f'{{model_name="{BUILTIN_MODEL}"}}'
    assert f"batchinfer:num_requests_running{label} 0.0" in metrics
    assert _sample(metrics, f"batchinfer:generation_tokens_total{label}") > 0
    assert _sample(metrics, f"batchinfer:prompt_tokens_total{label}") > 0
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert (data_dir / "batchinfer.db").is_file() and (data_dir / "broker.db").is_file()
    output = {entry["custom_id"]: entry for entry in map(json.loads, output_path.read_text().splitlines())}
    assert set(output) == {"france", "two-samples"}

    france = output["france"]["response"]["body"]
    assert france["object"] == "chat.completion"
    assert "Paris" in france["choices"][0]["message"]["content"]
    prompt_ids = served_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert france["usage"]["prompt_tokens"] == len(prompt_ids)

    samples = output["two-samples"]["response"]["body"]
    assert [choice["index"] for choice in samples["choices"]] == [0, 1]
    for choice in samples["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) >= 1
        assert all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert samples["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in samples["choices"])


def _sample(metrics: str, series: str) -> float:
    """The value of ``series`` (name and labels) in a Prometheus text exposition."""
    [value] = [line.split()[-1] for line in metrics.splitlines() if line.startswith(series + " ")]
    return float(value)


def _serve_children(serve: subprocess.Popen) -> dict[str, int]:
    """``serve``'s running children by role (``api``, ``beat``, ``worker <model>`` for each model) -> pid."""
    return {
        " ".join(argv[3:4] + (argv[5:6] if argv[3] == "worker" else [])): pid
        for pid, argv in child_processes(serve.pid).items()
        if argv[1:3] == ["-m", "worker.cli"]
    }


def test_serve_restarts_a_worker_killed_with_sigkill_and_stays_up(tmp_path):
    """``kill -9`` of the worker (what the OOM killer does) leaves the API and beat up and starts a new
    worker; Ctrl-C then stops everything cleanly. No job runs: the worker is killed while it loads."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    serve_log = tmp_path / "serve.log"
    with running(
        cli("serve", "--host", "127.0.0.1", "--port", str(port)), child_env(data_dir=str(tmp_path / "data")), serve_log
    ) as serve:
        wait_for_health(base_url, serve, serve_log)
        chat = f"worker {BUILTIN_MODEL}"
        before = _serve_children(serve)
        assert set(before) == {"api", chat, f"worker {BUILTIN_EMBEDDING_MODEL}", "beat"}, before
        os.kill(before[chat], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (after := _serve_children(serve)).get(chat) in (None, before[chat]):
            assert time.monotonic() < deadline and serve.poll() is None, serve_log.read_text()[-4000:]
            time.sleep(0.2)
        assert after == {**before, chat: after[chat]}
        assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=60) == 0, serve_log.read_text()[-4000:]
    assert (
        f"batchinfer: worker {BUILTIN_MODEL} exited with status -9 (killed by SIGKILL); restarting it in 1 s (restart 1)"
    ) in serve_log.read_text()


def test_serve_names_the_port_setting_when_the_port_is_taken(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        serve = subprocess.run(  # noqa: PLW1510 (the exit code is asserted below)
            cli("serve", "--host", "127.0.0.1", "--port", str(port), "--no-beat"),
            env=child_env(data_dir=str(tmp_path / "data")),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert serve.returncode == 3, serve.stderr
    assert (
        f"batchinfer: api exited with status 3; stopping: port {port} on 127.0.0.1 is in use (another "
        f"`batchinfer serve`?); pick another with --port or BATCHINFER_API_PORT"
    ) in serve.stderr
