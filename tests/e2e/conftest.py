"""End-to-end fixtures: the served tokenizer and a Redis database for a stack of a module's own.

Databases of the test Redis (``BATCHINFER_TEST_REDIS_URL``): 15 belongs to tests.helpers.service, 14 to
the stack the API-only tests share (tests/e2e/served/conftest.py), 1-13 to ``redis_url``. Two stacks never
share a Redis database: a worker takes every task of its queue, one that another stack's API sent included.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from jobs.config import BUILTIN_MODEL
from tests.e2e.processes import SHARED_STACK_REDIS_DB, redis_db_url
from worker.model_prepare import prepare_model


@pytest.fixture(scope="session")
def served_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_model(BUILTIN_MODEL))


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A Redis database (1-13) for a module's own stack, flushed before and after."""
    import redis

    url = redis_db_url(random.randint(1, SHARED_STACK_REDIS_DB - 1))
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()
