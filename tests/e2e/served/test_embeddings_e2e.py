"""Embeddings end to end: API and a worker serving the built-in embedding model (all-MiniLM-L6-v2) as child
processes (the shared stack of tests/e2e/served/conftest.py), driven through the `openai` SDK, as in
tests/e2e/served/test_service_e2e.py.

A ``/v1/embeddings`` batch of texts, token ids and lists of both, in float and base64: each response body
loads into the SDK's ``CreateEmbeddingResponse``, and the vectors read back (base64 decoded as the SDK does)
equal the engine's own for the same inputs (within 1e-6: the worker batched them with other lines); a bad
line fails alone.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from jobs.config import BUILTIN_EMBEDDING_MODEL
from tests.e2e.served.test_service_e2e import _read, _run
from worker.engine.pooling_engine import build_embedding_engine
from worker.model_prepare import prepare_model

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

EMBEDDINGS = "/v1/embeddings"


def _line(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": EMBEDDINGS,
        "body": {"model": BUILTIN_EMBEDDING_MODEL, **body},
    }


def test_an_embedding_batch_reads_back_the_engines_vectors(service):
    client, logs = service
    texts = ["The river runs to the sea.", "def add(a, b): return a + b", "batch inference on two cores"]
    inputs = {
        "one-text": texts[0],
        "texts": texts,
        "texts-base64": texts,
        "ids": [101, 7592, 2088, 102],
        "id-lists-base64": [[101, 7592, 102], [101, 2088, 2088, 2088, 102]],
    }
    lines = [
        _line(name, input=value, **({"encoding_format": "base64"} if name.endswith("base64") else {}))
        for name, value in inputs.items()
    ]
    lines.append(_line("empty", input=""))

    batch = _run(client, logs, lines, EMBEDDINGS, timeout_s=600)

    assert batch.status == "completed"
    output, errors = _read(client, batch.output_file_id), _read(client, batch.error_file_id)
    assert set(errors) == {"empty"} and errors["empty"]["response"]["status_code"] == 400
    engine = build_embedding_engine(prepare_model(BUILTIN_EMBEDDING_MODEL))
    for name, value in inputs.items():
        body = output[name]["response"]["body"]
        if name.endswith("base64"):
            # NOTE: decoded as the SDK's embeddings.create decodes a base64 answer before it builds the model.
            for item in body["data"]:
                item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="float32").tolist()
        response = CreateEmbeddingResponse.model_validate(body)
        items = value if isinstance(value, list) and not isinstance(value[0], int) else [value]
        token_ids = [engine.tokenize(item) if isinstance(item, str) else item for item in items]
        vectors = np.asarray([d.embedding for d in response.data], dtype=np.float32)
        assert response.model == BUILTIN_EMBEDDING_MODEL and [d.index for d in response.data] == list(range(len(items)))
        np.testing.assert_allclose(vectors, engine.embed(token_ids).numpy(), atol=1e-6, rtol=0)
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(ids) for ids in token_ids)
