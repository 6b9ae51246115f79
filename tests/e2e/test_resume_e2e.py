"""A long line survives its worker's SIGTERM (issue #25, "Partial work survives"; docs/operations.md, "Checkpoints").

Two real workers (``batchinfer worker``, SmolLM2) share a PostgreSQL database and a Redis broker of the test's
own. One greedy line of 2,000 tokens (``ignore_eos``) runs on whichever worker claims it; once its checkpoint
holds about 1,000 tokens that worker gets SIGTERM: it checkpoints the line, hands the shard back and exits,
and the other worker resumes the line from the checkpoint (one prefill over prompt + generated tokens). The
output must equal the uninterrupted run, computed meanwhile by the same engine in this process, and at most
10% of the tokens may have been generated twice (the line's ``recomputed_tokens``); the second worker's
metrics show it generated only the rest.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from jobs.config import BUILTIN_MODEL, Settings
from jobs.db import session_scope
from jobs.models import BatchRequest, BatchShard
from tests.e2e.processes import TERMINAL, child_env, cli, free_port, running, wait_for_health
from tests.e2e.test_shards_e2e import redis_server
from tests.helpers.monitoring import parse_scrape, sample_value
from tests.helpers.service import postgres_database

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

NUM_TOKENS, INTERRUPT_AT = 2000, 1000
BODY = {
    "model": BUILTIN_MODEL,
    "prompt": "The lighthouse keeper opened his logbook and wrote:",
    "max_tokens": NUM_TOKENS,
    "temperature": 0,
    "ignore_eos": True,
}


def _uninterrupted(result: dict) -> None:
    """The line's uninterrupted output, by this process's engine with the workers' settings."""
    import torch

    from worker.bootstrap import engine_config
    from worker.engine import LLMEngine
    from worker.request_mapping import map_request

    torch.set_num_threads(1)
    engine = LLMEngine(engine_config(Settings()))
    request = map_request("/v1/completions", BODY, engine.tokenizer)
    (output,) = engine.generate([request.prompt_token_ids], request.params)
    result["output"], result["num_prompt_tokens"] = output.outputs[0], len(request.prompt_token_ids)


def _line(database_url: str, batch_id: str) -> tuple[list[int] | None, int, str | None]:
    """The line's checkpoint, recomputed tokens, and the owner of its shard's lease (None, 0, None while the
    batch is still validating: its line has no row yet)."""
    with session_scope(database_url) as session:
        row = session.execute(
            select(BatchRequest.checkpoint_token_ids, BatchRequest.recomputed_tokens, BatchShard.lease_owner)
            .join(BatchShard, BatchShard.id == BatchRequest.shard_id)
            .where(BatchRequest.batch_id == batch_id)
        ).one_or_none()
    return (None, 0, None) if row is None else (row[0], row[1], row[2])


def test_a_long_line_interrupted_by_sigterm_resumes_from_its_checkpoint_on_another_worker(tmp_path: Path):
    from openai import OpenAI

    reference: dict = {}
    computing = threading.Thread(target=_uninterrupted, args=(reference,), daemon=True)
    computing.start()
    with ExitStack() as stack:
        database_url = stack.enter_context(postgres_database())
        redis_port = free_port()
        stack.enter_context(redis_server(redis_port, tmp_path / "redis"))
        env = child_env(
            data_dir=str(tmp_path / "data"),
            database_url=database_url,
            broker_url=f"redis://127.0.0.1:{redis_port}/0",
            checkpoint_interval_s="2",
            worker_metrics_host="127.0.0.1",
        )
        api_port = free_port()
        api_log = tmp_path / "api.log"
        api = stack.enter_context(running(cli("api", "--host", "127.0.0.1", "--port", str(api_port)), env, api_log))
        workers, logs, metrics_ports = [], [], []
        for index in range(2):
            metrics_ports.append(free_port())
            logs.append(tmp_path / f"worker{index}.log")
            worker_env = dict(env, BATCHINFER_WORKER_METRICS_PORT=str(metrics_ports[-1]))
            workers.append(stack.enter_context(running(cli("worker", "--loglevel", "INFO"), worker_env, logs[-1])))

        def tails() -> str:
            return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in [api_log, *logs] if p.exists())

        base_url = f"http://127.0.0.1:{api_port}"
        wait_for_health(base_url, api, api_log)
        deadline = time.monotonic() + 900
        for worker, log in zip(workers, logs, strict=True):
            while not (log.exists() and " ready." in log.read_text()):
                assert worker.poll() is None and time.monotonic() < deadline, f"a worker did not start\n{tails()}"
                time.sleep(0.5)

        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused")
        line = {"custom_id": "long", "method": "POST", "url": "/v1/completions", "body": BODY}
        upload = client.files.create(file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
        batch_id = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        ).id

        deadline = time.monotonic() + 1200
        while True:
            checkpoint, _, owner = _line(database_url, batch_id)
            if checkpoint is not None and len(checkpoint) >= INTERRUPT_AT:
                break
            assert time.monotonic() < deadline, f"no checkpoint of {INTERRUPT_AT} tokens\n{tails()}"
            time.sleep(0.2)
        assert owner is not None
        (victim_index,) = [i for i, w in enumerate(workers) if owner.endswith(f":{w.pid}")]
        victim, survivor = workers[victim_index], workers[1 - victim_index]
        victim.send_signal(signal.SIGTERM)
        assert victim.wait(timeout=120) == 0, tails()
        handed_back, recomputed_at_stop, _ = _line(database_url, batch_id)
        assert handed_back is not None and len(handed_back) >= len(checkpoint), "no checkpoint at the hand-back"

        deadline = time.monotonic() + 1200
        while (batch := client.batches.retrieve(batch_id)).status not in TERMINAL:
            assert time.monotonic() < deadline and survivor.poll() is None, f"batch {batch.status}\n{tails()}"
            time.sleep(1)
        assert batch.status == "completed", tails()
        (entry,) = [json.loads(text) for text in client.files.content(batch.output_file_id).text.splitlines()]
        scrape = parse_scrape(httpx.get(f"http://127.0.0.1:{metrics_ports[1 - victim_index]}/metrics", timeout=10).text)
        _, recomputed_tokens, _ = _line(database_url, batch_id)

    computing.join(timeout=1800)
    assert "output" in reference, "the uninterrupted reference run did not finish"
    expected = reference["output"]
    body = entry["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"] == expected.text
    assert choice["finish_reason"] == expected.finish_reason == "length"
    assert body["usage"]["completion_tokens"] == len(expected.token_ids) == NUM_TOKENS
    assert body["usage"]["prompt_tokens"] == reference["num_prompt_tokens"]
    # Generated twice: what the stopped worker threw away (nothing, when its final checkpoint was written).
    assert recomputed_tokens == recomputed_at_stop <= NUM_TOKENS // 10
    resumed = sample_value(scrape, "batchinfer:resumed_tokens_total")
    assert resumed == len(handed_back) >= INTERRUPT_AT
    assert sample_value(scrape, "batchinfer:generation_tokens_total") == NUM_TOKENS - resumed
