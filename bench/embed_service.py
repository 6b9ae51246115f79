"""The service side of bench/embed.py: the texts as ``/v1/embeddings`` lines through ``batchinfer serve``, upload to completed.

Starts the zero-setup stack in a fresh data folder (``batchinfer serve``: SQLite, the embedded broker, the API,
beat and one worker) with the built-in embedding model as the only model (``BATCHINFER_MODEL=all-MiniLM-L6-v2``,
so no chat worker shares the cores) and the worker on ``--threads`` torch threads. Once ``/v1/models`` says its
worker is ready, a warm-up batch of the first 64 texts runs untimed (a deployment that has served before:
oneDNN's first primitives, first touch), then the measured one: the real ``openai`` SDK uploads the JSONL
(``files.create``) and creates the batch (``batches.create``, endpoint ``/v1/embeddings``), and polls
``batches.retrieve`` every ``POLL_S`` until it is terminal. The clock runs from the upload's first byte to the
poll that sees ``completed``: the JSONL is built before, the output is downloaded after (``download_s``).

Lines: ``--texts-per-line`` texts per line, ``input`` a list of strings (one string when 1), as a user embedding
a data set writes them (OpenAI takes up to 2048 inputs per request); ``--encoding`` is the lines'
``encoding_format`` (``float``, OpenAI's default, or ``base64``). The embeddings read back are written to OUT_NPY
in text order.

Usage: python bench/embed_service.py TEXTS_JSON MODEL_NAME OUT_NPY [--threads 2] [--texts-per-line 100]
       [--encoding float]
Prints one JSON line: ``texts_per_s`` and ``elapsed_s`` (upload to completed), ``upload_s`` (files.create),
``queued_s`` / ``running_s`` (the batch's own timestamps: created to in_progress, in_progress to completed;
whole seconds), ``download_s``, ``num_lines``, ``startup_s`` (serve to worker ready) and the batch's
``request_counts``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

POLL_S = 0.5
READY_TIMEOUT_S = 600.0
WARMUP_TEXTS = 64
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_env(data_dir: Path, model: str, threads: int) -> dict[str, str]:
    """This environment without other ``BATCHINFER_*`` settings (the model cache kept), serving ``model`` only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_") or k == "BATCHINFER_MODEL_CACHE_DIR"}
    env.update(
        BATCHINFER_DATA_DIR=str(data_dir),
        BATCHINFER_MODEL=model,
        BATCHINFER_TORCH_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    return env


def _jsonl(texts: list[str], model: str, per_line: int, encoding: str) -> bytes:
    lines = []
    for number, start in enumerate(range(0, len(texts), per_line)):
        chunk = texts[start : start + per_line]
        body = {"model": model, "input": chunk[0] if per_line == 1 else chunk, "encoding_format": encoding}
        lines.append(json.dumps({"custom_id": f"t{number}", "method": "POST", "url": "/v1/embeddings", "body": body}))
    return ("\n".join(lines) + "\n").encode()


def _wait_ready(base_url: str, model: str, serve: subprocess.Popen[bytes], log: Path) -> None:
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            sys.exit(f"batchinfer serve exited with {serve.returncode}:\n{log.read_text()[-4000:]}")
        try:
            models = httpx.get(f"{base_url}/v1/models", timeout=5).json()["data"]
            if any(m["id"] == model and m["num_ready_workers"] > 0 for m in models):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    sys.exit(f"no ready worker for {model} within {READY_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _run_batch(client: Any, data: bytes) -> tuple[Any, float, float]:
    """Upload ``data`` and run it as a batch to a terminal state: (batch, seconds to terminal, upload seconds)."""
    start = time.perf_counter()
    uploaded = client.files.create(file=("texts.jsonl", data), purpose="batch")
    upload_s = time.perf_counter() - start
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    while batch.status not in TERMINAL:
        time.sleep(POLL_S)
        batch = client.batches.retrieve(batch.id)
    return batch, time.perf_counter() - start, upload_s


def _read_embeddings(client: Any, batch: Any, num_texts: int) -> Any:
    import numpy as np

    rows: dict[int, list[Any]] = {}
    for line in client.files.content(batch.output_file_id).text.splitlines():
        record = json.loads(line)
        data = sorted(record["response"]["body"]["data"], key=lambda item: item["index"])
        rows[int(record["custom_id"][1:])] = [
            np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
            if isinstance(item["embedding"], str)
            else np.asarray(item["embedding"], dtype=np.float32)
            for item in data
        ]
    vectors = [vector for number in sorted(rows) for vector in rows[number]]
    if len(vectors) != num_texts:
        sys.exit(f"the output holds {len(vectors)} embeddings for {num_texts} texts")
    return np.stack(vectors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("texts", type=Path)
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--texts-per-line", type=int, default=100)
    parser.add_argument("--encoding", choices=["float", "base64"], default="float")
    args = parser.parse_args()
    import numpy as np
    from openai import OpenAI

    texts: list[str] = json.loads(args.texts.read_text())
    data_dir = Path(tempfile.mkdtemp(prefix="bench-embed-service-"))
    log = data_dir / "serve.log"
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "worker.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    started = time.perf_counter()
    with log.open("wb") as log_file:
        serve = subprocess.Popen(
            command,
            cwd=ROOT,
            env=_serve_env(data_dir, args.model, args.threads),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_ready(base_url, args.model, serve, log)
        startup_s = time.perf_counter() - started
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600)
        warmup, _, _ = _run_batch(client, _jsonl(texts[:WARMUP_TEXTS], args.model, args.texts_per_line, args.encoding))
        if warmup.status != "completed":
            sys.exit(f"the warm-up batch ended {warmup.status}:\n{log.read_text()[-4000:]}")
        data = _jsonl(texts, args.model, args.texts_per_line, args.encoding)
        batch, elapsed, upload_s = _run_batch(client, data)
        counts = batch.request_counts.model_dump() if batch.request_counts else {}
        if batch.status != "completed" or counts.get("failed"):
            sys.exit(f"the batch ended {batch.status} ({counts}):\n{log.read_text()[-4000:]}")
        download_start = time.perf_counter()
        embeddings = _read_embeddings(client, batch, len(texts))
        download_s = time.perf_counter() - download_start
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
    np.save(args.out, embeddings.astype(np.float32))
    result = {
        "texts_per_s": len(texts) / elapsed,
        "elapsed_s": elapsed,
        "upload_s": upload_s,
        "queued_s": batch.in_progress_at - batch.created_at if batch.in_progress_at else None,
        "running_s": batch.completed_at - batch.in_progress_at if batch.in_progress_at else None,
        "download_s": download_s,
        "num_lines": data.count(b"\n"),
        "startup_s": startup_s,
        "request_counts": counts,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
