"""The served stack the API-only end-to-end tests of this folder share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from jobs.config import BUILTIN_EMBEDDING_MODEL, BUILTIN_MODEL
from tests.e2e.processes import (
    SHARED_STACK_REDIS_DB,
    child_env,
    cli,
    free_port,
    interrupt,
    redis_db_url,
    running,
    wait_for_health,
)
from tests.helpers.service import postgres_database


@pytest.fixture(scope="package")
def service(tmp_path_factory) -> Iterator[tuple[object, list[Path]]]:
    """The served stack the API-only tests share; yields ``(openai_client, log_paths)``.

    ``batchinfer api``, ``beat``, two workers of the built-in chat model and one of the built-in embedding
    model, as child processes on a PostgreSQL database and a Redis database (14) of their own; started by
    the first test of this folder and stopped after its last, so its workers are gone before the tests that
    start stacks of their own (several real-model workers) run. Tests that use it keep to their own batches,
    files and evals: it has served other tests before, so a count over the whole service is not theirs. A
    test that stops processes, changes settings or reads process-wide figures (a worker's metrics) starts a
    stack of its own, outside this folder.

    NOTE: ``shard_target_tokens`` 20,000 (not 65,536) cuts the 164-line HumanEval job into two shards (87
    and 77 lines), one for each chat worker: CI has two cores, and one worker (one torch thread) would
    leave the other idle while the test waits. Not smaller: a token costs more in a smaller batch (34
    HumanEval prompts in two batches of 17 took 40% more CPU than in one batch of 34).
    """
    import redis
    from openai import OpenAI

    data_dir = tmp_path_factory.mktemp("shared-stack")
    redis_url = redis_db_url(SHARED_STACK_REDIS_DB)
    broker = redis.Redis.from_url(redis_url)
    broker.flushdb()
    port = free_port()
    with postgres_database() as database_url, ExitStack() as stack:
        env = child_env(
            data_dir=str(data_dir), database_url=database_url, broker_url=redis_url, shard_target_tokens="20000"
        )
        logs = [data_dir / f"{name}.log" for name in ("api", "beat", "worker-0", "worker-1", "embedding-worker")]
        commands = [
            cli("api", "--host", "127.0.0.1", "--port", str(port)),
            cli("beat"),
            cli("worker", "--model", BUILTIN_MODEL),
            cli("worker", "--model", BUILTIN_MODEL),
            cli("worker", "--model", BUILTIN_EMBEDDING_MODEL),
        ]
        processes = [
            stack.enter_context(running(command, env, log)) for command, log in zip(commands, logs, strict=True)
        ]
        base_url = f"http://127.0.0.1:{port}"
        wait_for_health(base_url, processes[0], logs[0])
        yield OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60), logs
        interrupt(processes)
    broker.flushdb()
    broker.close()
