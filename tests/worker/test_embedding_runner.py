"""``/v1/embeddings`` lines through the runner: a tiny random BERT's engine and a real (SQLite) database.

The bad-input table of docs/api.md ("Embeddings"): each bad line is a 400 of its own, its neighbours run.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from jobs.config import BUILTIN_MODEL
from jobs.status import BatchStatus
from tests.helpers.stand_in_engine import StandInEngine, run_batch
from tests.helpers.tiny_models import save_tiny_bert
from tests.worker.test_runner import make_batch, read_results, service  # noqa: F401 (the fixture)
from tests.worker.test_telemetry import scrape
from worker.engine.pooling_engine import build_embedding_engine
from worker.metrics import EngineMetrics
from worker.telemetry import WorkerActivity, WorkerTelemetry

EMBEDDINGS = "/v1/embeddings"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_embedding_engine(save_tiny_bert(tmp_path_factory.mktemp("tiny-bert")), max_num_batched_tokens=128)


def embedding(input_, **fields) -> dict:
    return {"model": BUILTIN_MODEL, "input": input_, **fields}


def test_embedding_lines_answer_openai_bodies_and_bad_lines_fail_alone(service, engine):
    text = "an embedded sentence"
    bodies = {
        "text": embedding(text),
        "texts": embedding(["one", "two three", text]),
        "ids": embedding([5, 6, 7]),
        "id lists": embedding([[5, 6], [7, 8, 9]]),
        "base64": embedding([text, "two three"], encoding_format="base64"),
        "truncated": embedding("x" * 300, truncate_prompt_tokens=-1),
        "empty string": embedding(""),
        "empty list": embedding([]),
        "empty item": embedding(["fine", ""]),
        "too many tokens": embedding([3] * 129),
        "too long text": embedding(["fine", "x" * 300]),
        "out of vocabulary": embedding([5, 259, 1000]),
        "dimensions": embedding(text, dimensions=16),
    }
    batch_id = make_batch(list(bodies.values()), endpoint=EMBEDDINGS)

    assert run_batch(batch_id, engine=engine) == BatchStatus.COMPLETED

    batch, output, errors = read_results(batch_id)
    line_of = {name: f"line-{n}" for n, name in enumerate(bodies, start=1)}
    assert set(output) == {line_of[name] for name in list(bodies)[:6]}
    assert (batch.completed_requests, batch.failed_requests) == (6, 7)
    reference = {
        name: engine.embed([engine.tokenize(t) for t in texts])
        for name, texts in (("text", [text]), ("texts", ["one", "two three", text]), ("base64", [text, "two three"]))
    }
    reference["ids"] = engine.embed([[5, 6, 7]])
    reference["id lists"] = engine.embed([[5, 6], [7, 8, 9]])
    reference["truncated"] = engine.embed([engine.tokenize("x" * 300, -1)])
    for name, expected in reference.items():
        body = output[line_of[name]]["response"]["body"]
        assert body["object"] == "list" and body["model"] == BUILTIN_MODEL
        assert [item["index"] for item in body["data"]] == list(range(len(expected)))
        assert all(item["object"] == "embedding" for item in body["data"])
        if name == "base64":
            vectors = [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in body["data"]]
        else:
            vectors = [np.asarray(item["embedding"], dtype=np.float32) for item in body["data"]]
        torch.testing.assert_close(torch.from_numpy(np.stack(vectors)), expected, atol=1e-6, rtol=1e-6)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    assert output[line_of["truncated"]]["response"]["body"]["usage"]["prompt_tokens"] == 128
    assert output[line_of["ids"]]["response"]["body"]["usage"]["prompt_tokens"] == 3

    def error(name: str) -> dict:
        response = errors[line_of[name]]["response"]
        assert response["status_code"] == 400
        return response["body"]["error"]

    assert error("empty string")["param"] == "input" and "empty string" in error("empty string")["message"]
    assert "empty list" in error("empty list")["message"]
    assert "item 1 is empty" in error("empty item")["message"]
    assert error("too many tokens")["code"] == "context_length_exceeded"
    assert "129 tokens" in error("too many tokens")["message"] and "at most 128" in error("too many tokens")["message"]
    assert error("too long text")["message"].startswith("line 11: input[1] has 300 tokens")
    assert error("out of vocabulary")["param"] == "input" and "259, 1000" in error("out of vocabulary")["message"]
    assert error("out of vocabulary")["message"].startswith("line 12: input: holds token ids outside the vocabulary")
    assert error("dimensions")["param"] == "dimensions" and "Matryoshka" in error("dimensions")["message"]


def test_an_endpoint_the_model_does_not_serve_is_a_400_per_line(service, engine, served_tokenizer):
    to_generator = make_batch([embedding("a"), embedding("b")], endpoint=EMBEDDINGS)
    assert run_batch(to_generator, engine=StandInEngine(served_tokenizer)) == BatchStatus.COMPLETED
    to_embedder = make_batch([{"model": BUILTIN_MODEL, "prompt": "a", "max_tokens": 2}])
    assert run_batch(to_embedder, engine=engine) == BatchStatus.COMPLETED

    for batch_id, words in ((to_generator, "generates text"), (to_embedder, "is an embedding model")):
        batch, output, errors = read_results(batch_id)
        assert output == {} and batch.failed_requests == len(errors) > 0
        for entry in errors.values():
            error = entry["response"]["body"]["error"]
            assert entry["response"]["status_code"] == 400 and error["param"] == "model" and words in error["message"]


def test_embedding_lines_show_as_running_in_the_metrics_and_the_heartbeat(service, engine, monkeypatch):
    # A user watching /metrics or /ui while an embedding batch runs must see its lines running, as for chat.
    bodies = [embedding(["one", "two three"]), embedding("four"), embedding([5, 6, 7])]
    batch_id = make_batch(bodies, endpoint=EMBEDDINGS)
    telemetry = WorkerTelemetry(EngineMetrics("m"), WorkerActivity())
    seen: list[tuple[float, float, int]] = []
    embed = engine.embed

    def watched_embed(*args, **kwargs):
        samples = scrape(telemetry.metrics.registry)
        running = samples["batchinfer:num_requests_running{}"]
        seen.append((running, samples["batchinfer:num_requests_waiting{}"], telemetry.activity.num_running_requests))
        return embed(*args, **kwargs)

    monkeypatch.setattr(engine, "embed", watched_embed)

    assert run_batch(batch_id, engine=engine, observer=telemetry) == BatchStatus.COMPLETED

    assert seen == [(3, 0, 3)]  # one chunk of all three lines
    samples = scrape(telemetry.metrics.registry)
    assert samples["batchinfer:num_requests_running{}"] == samples["batchinfer:num_requests_waiting{}"] == 0
    batch, _, _ = read_results(batch_id)
    assert samples["batchinfer:prompt_tokens_total{}"] == batch.input_tokens > 0
    assert telemetry.activity.num_running_requests == 0
