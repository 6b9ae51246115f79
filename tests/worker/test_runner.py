"""The runner against a small stand-in engine and a real (SQLite) database.

The stand-in honours `LLMEngine`'s contract (add_request / step / abort_request, PromptTooLongError,
one token per running sequence per step, at most ``max_num_seqs`` running) so these tests pin the
runner's own behaviour: one stream, results persisted as they land, cancel, expiry, failures confined.
The real engine runs in tests/e2e.
"""

from __future__ import annotations

import json

import pytest

from jobs import intake, repository
from jobs.config import BUILTIN_MODEL, get_settings
from jobs.db import dispose_engines, session_scope, upgrade_database
from jobs.files import file_chunks, get_file, write_file
from jobs.status import BatchStatus
from jobs.validation import ValidatedLine
from tests.helpers.service import completion_line, jsonl
from tests.helpers.stand_in_engine import StandInEngine, run_batch
from worker import runner


@pytest.fixture
def service(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path))
    for name in ("BATCHINFER_DATABASE_URL", "BATCHINFER_BROKER_URL", "BATCHINFER_FILES_DIR"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    upgrade_database()
    yield get_settings()
    dispose_engines()
    get_settings.cache_clear()


def make_batch(bodies: list[dict], endpoint: str = "/v1/completions") -> str:
    """An in-progress batch whose lines are ``bodies`` (custom_id ``line-N``), as the API leaves it."""
    lines = [ValidatedLine(n, f"line-{n}", body) for n, body in enumerate(bodies, start=1)]
    raw = "".join(
        json.dumps({"custom_id": line.custom_id, "method": "POST", "url": endpoint, "body": line.body}) + "\n"
        for line in lines
    )
    with session_scope() as session:
        file = write_file(session, chunks=[raw.encode()], filename="in.jsonl", purpose="batch")
        batch = repository.create_batch(session, input_file_id=file.id, endpoint=endpoint)
        repository.apply_validation(session, batch_id=batch.id, lines=lines, errors=[], model=BUILTIN_MODEL)
        return batch.id


def read_results(batch_id: str) -> tuple[object, dict[str, dict], dict[str, dict]]:
    with session_scope() as session:
        batch = repository.get_batch(session, batch_id=batch_id)
        files = []
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id is None:
                files.append({})
                continue
            text = b"".join(file_chunks(get_file(session, file_id=file_id))).decode()
            files.append({(e := json.loads(line))["custom_id"]: e for line in text.splitlines()})
    return batch, files[0], files[1]


def completion(prompt: str, **fields) -> dict:
    return {"model": BUILTIN_MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, **fields}


def test_all_lines_run_as_one_stream_and_complete(service, served_tokenizer):
    bodies = [completion(f"def f{i}(x):\n", max_tokens=2 + i % 3) for i in range(10)]
    batch_id = make_batch(bodies)
    engine = StandInEngine(served_tokenizer)

    status = run_batch(batch_id, engine=engine, commit_every=3, check_every_steps=2)

    assert status == BatchStatus.COMPLETED
    assert engine.num_added_at_first_step == 10  # every line queued before the first step
    assert not engine.has_unfinished_requests()
    batch, output, errors = read_results(batch_id)
    assert (batch.total_requests, batch.completed_requests, batch.failed_requests) == (10, 10, 0)
    assert errors == {} and batch.error_file_id is None
    assert set(output) == {f"line-{n}" for n in range(1, 11)}
    for n, body in enumerate(bodies, start=1):
        response = output[f"line-{n}"]["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        result = response["body"]
        assert result["object"] == "text_completion" and result["model"] == BUILTIN_MODEL
        assert result["usage"]["prompt_tokens"] == len(served_tokenizer.encode(body["prompt"]))
        assert result["usage"]["completion_tokens"] == body["max_tokens"]
        assert result["choices"][0]["text"] == " ok" * body["max_tokens"]
    assert batch.input_tokens == sum(output[k]["response"]["body"]["usage"]["prompt_tokens"] for k in output)
    assert batch.output_tokens == sum(b["max_tokens"] for b in bodies)


def test_request_counts_move_while_the_batch_runs(service, served_tokenizer):
    batch_id = make_batch([completion(f"p{i}") for i in range(12)])
    seen: list[int] = []

    def look(_step: int) -> None:
        with session_scope() as session:
            seen.append(repository.get_batch(session, batch_id=batch_id).completed_requests)

    run_batch(batch_id, engine=StandInEngine(served_tokenizer, on_step=look), commit_every=2, check_every_steps=1)

    assert any(0 < count < 12 for count in seen), seen
    assert seen == sorted(seen)


def test_too_long_and_invalid_lines_fail_alone(service, served_tokenizer):
    long_prompt = "word " * 100
    bodies = [
        completion("fine one"),
        completion(long_prompt),
        completion("bad temperature", temperature=-1),
        completion("fine two"),
    ]
    batch_id = make_batch(bodies)
    engine = StandInEngine(served_tokenizer, max_model_len=64)

    assert run_batch(batch_id, engine=engine) == BatchStatus.COMPLETED

    batch, output, errors = read_results(batch_id)
    assert set(output) == {"line-1", "line-4"}
    assert set(errors) == {"line-2", "line-3"}
    assert (batch.completed_requests, batch.failed_requests) == (2, 2)
    too_long = errors["line-2"]["response"]
    assert too_long["status_code"] == 400
    error = too_long["body"]["error"]
    num_prompt_tokens = len(served_tokenizer.encode(long_prompt))
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    assert error["message"].startswith("line 2: ")
    assert str(num_prompt_tokens) in error["message"] and "64" in error["message"]
    bad = errors["line-3"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"
    assert errors["line-2"]["error"] is None


@pytest.mark.parametrize(
    ("bad_fields", "param"),
    [({"prompt": ""}, "prompt"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature")],
)
def test_a_body_the_endpoint_rejects_is_a_400_for_its_line_alone(
    service, served_tokenizer, monkeypatch, bad_fields, param
):
    """The file passes validation (its structure is fine); the worker's parse of the middle body fails,
    so that line is a 400 in the error file, named by ``param`` in plain words, and its neighbours run."""
    lines = [
        completion_line("first", max_tokens=2),
        completion_line("middle", **bad_fields),
        completion_line("last", max_tokens=2),
    ]
    settings = get_settings()
    with session_scope() as session:
        file = write_file(session, chunks=[jsonl(lines)], filename="in.jsonl", purpose="batch")
        batch_id = repository.create_batch(session, input_file_id=file.id, endpoint="/v1/completions").id
    monkeypatch.setattr(intake, "enqueue_shards", lambda *args, **kwargs: 0)
    assert intake.validate_and_start(batch_id, settings=settings) == BatchStatus.IN_PROGRESS

    assert run_batch(batch_id, engine=StandInEngine(served_tokenizer)) == BatchStatus.COMPLETED

    batch, output, errors = read_results(batch_id)
    assert set(output) == {"first", "last"} and set(errors) == {"middle"}
    assert (batch.total_requests, batch.completed_requests, batch.failed_requests) == (3, 2, 1)
    envelope = errors["middle"]
    assert envelope["error"] is None
    assert envelope["response"]["status_code"] == 400
    error = envelope["response"]["body"]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"].startswith(f"line 2: {param}: must be ")
    with session_scope() as session:
        envelopes = b"".join(file_chunks(get_file(session, file_id=batch.error_file_id))).decode().splitlines()
    assert len(envelopes) == 1


def test_cancel_aborts_in_flight_lines_and_keeps_finished(service, served_tokenizer):
    batch_id = make_batch([completion(f"p{i}", max_tokens=4) for i in range(12)])

    def cancel_at(step: int) -> None:
        if step == 5:
            with session_scope() as session:
                repository.cancel_batch(session, batch_id=batch_id)

    engine = StandInEngine(served_tokenizer, on_step=cancel_at)
    assert run_batch(batch_id, engine=engine, check_every_steps=2) == BatchStatus.CANCELLED

    assert not engine.has_unfinished_requests() and engine.aborted
    batch, output, errors = read_results(batch_id)
    assert len(output) == 4  # the first four lines finished at step 4
    assert set(output) | set(errors) == {f"line-{n}" for n in range(1, 13)}
    assert not set(output) & set(errors)
    assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
    assert (batch.completed_requests, batch.failed_requests) == (4, 8)
    assert batch.cancelled_at is not None


def test_expiry_stops_the_run_and_keeps_finished(service, served_tokenizer):
    batch_id = make_batch([completion(f"p{i}", max_tokens=4) for i in range(12)])
    with session_scope() as session:
        expires_at = repository.get_batch(session, batch_id=batch_id).expires_at
    now = [float(expires_at - 100)]

    def pass_expiry(step: int) -> None:
        if step == 5:
            now[0] = expires_at + 1

    engine = StandInEngine(served_tokenizer, on_step=pass_expiry)
    status = run_batch(batch_id, engine=engine, check_every_steps=2, clock=lambda: now[0])

    assert status == BatchStatus.EXPIRED
    assert not engine.has_unfinished_requests()
    _, output, errors = read_results(batch_id)
    assert len(output) == 4 and len(errors) == 8
    assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}


def test_engine_fault_fails_lines_in_flight_but_not_the_batch(service, served_tokenizer):
    batch_id = make_batch([completion(f"p{i}", max_tokens=2) for i in range(8)])

    def explode(step: int) -> None:
        if step == 2:
            raise RuntimeError("device lost")

    engine = StandInEngine(served_tokenizer, on_step=explode)
    assert run_batch(batch_id, engine=engine) == BatchStatus.COMPLETED

    assert not engine.has_unfinished_requests()
    _, output, errors = read_results(batch_id)
    assert len(output) == 4 and len(errors) == 4
    for envelope in errors.values():
        assert envelope["response"]["status_code"] == 500
        assert "device lost" in envelope["response"]["body"]["error"]["message"]


def test_n_choices_and_chat_endpoint(service, served_tokenizer):
    chat = {
        "model": BUILTIN_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "n": 3,
        "max_tokens": 2,
        "logprobs": True,
    }
    batch_id = make_batch([chat, dict(chat, n=1)], endpoint="/v1/chat/completions")

    assert run_batch(batch_id, engine=StandInEngine(served_tokenizer)) == BatchStatus.COMPLETED

    _, output, _ = read_results(batch_id)
    body = output["line-1"]["response"]["body"]
    assert body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in body["choices"]}) == 3
    assert body["usage"]["completion_tokens"] == 6
    assert len(body["choices"][0]["logprobs"]["content"]) == 2


def test_rerun_of_a_finished_batch_is_a_no_op(service, served_tokenizer):
    batch_id = make_batch([completion("p")])
    engine = StandInEngine(served_tokenizer)
    assert run_batch(batch_id, engine=engine) == BatchStatus.COMPLETED
    steps = engine.num_steps
    assert run_batch(batch_id, engine=engine) == BatchStatus.COMPLETED
    assert engine.num_steps == steps
    assert runner.run_next_shard(engine=engine) is None


def test_lines_the_engine_drops_fail_instead_of_hanging(service, served_tokenizer):
    batch_id = make_batch([completion(f"p{i}", max_tokens=2) for i in range(3)])
    with session_scope() as session:
        lost_id = repository.pending_requests(session, batch_id=batch_id)[1].id

    class Forgetful(StandInEngine):
        def step(self):
            return [out for out in super().step() if out.request_id != lost_id]

    assert run_batch(batch_id, engine=Forgetful(served_tokenizer)) == BatchStatus.COMPLETED
    _, output, errors = read_results(batch_id)
    assert set(output) == {"line-1", "line-3"}
    assert errors["line-2"]["response"]["status_code"] == 500


def test_token_ids_outside_the_vocabulary_or_an_unreachable_min_tokens_fail_their_line_alone_on_the_real_engine(
    service, tmp_path
):
    """Token ids (prompt, ``logit_bias``, ``stop_token_ids``) pass validation (the API has no model), and so
    does a ``min_tokens`` the prompt leaves no room for; each is rejected when its line joins the engine,
    before any step, naming the field: the neighbours run normally."""
    from tests.helpers.tiny_llama import save_tiny_llama
    from worker.engine import EngineConfig, LLMEngine

    model_dir = save_tiny_llama(tmp_path / "tiny")
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=64, kv_cache_memory_bytes=1 << 22))
    vocab_size = engine.model_config.vocab_size
    bodies = [
        completion("fine one"),
        completion("biased", logit_bias={"3": 5, str(vocab_size + 5): 5}),
        completion([1, vocab_size]),
        completion("stops", stop_token_ids=[2, vocab_size + 7]),
        completion([5] * 60, min_tokens=10, max_tokens=16),
        completion([5] * 50, min_tokens=10, max_tokens=16, ignore_eos=True),
        completion("fine two", temperature=1.0, seed=3),
    ]
    batch_id = make_batch(bodies)

    assert run_batch(batch_id, engine=engine) == BatchStatus.COMPLETED

    _, output, errors = read_results(batch_id)
    assert set(output) == {"line-1", "line-6", "line-7"}
    assert output["line-6"]["response"]["body"]["usage"]["completion_tokens"] >= 10
    expected = {
        "line-2": ("logit_bias", [str(vocab_size), str(vocab_size + 5)]),
        "line-3": ("prompt", [str(vocab_size)]),
        "line-4": ("stop_token_ids", [str(vocab_size), str(vocab_size + 7)]),
        "line-5": ("min_tokens", ["10", "60", "64"]),
    }
    assert set(errors) == set(expected)
    for custom_id, (param, numbers) in expected.items():
        response = errors[custom_id]["response"]
        assert response["status_code"] == 400
        error = response["body"]["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_value", param)
        assert all(number in error["message"] for number in numbers), error["message"]
        assert error["message"].startswith(f"line {custom_id.removeprefix('line-')}: "), error["message"]


def test_a_stop_signal_hands_the_shard_back_and_fails_no_line(service, served_tokenizer):
    """The stop event (what SIGTERM / SIGQUIT / Ctrl-C set in a worker) ends the run after the current
    step: finished lines are recorded, the rest stay pending in a queued shard, nothing is an error."""
    import threading

    from jobs.models import BatchShard

    batch_id = make_batch([completion(f"p{i}", max_tokens=4) for i in range(12)])
    stop = threading.Event()
    engine = StandInEngine(served_tokenizer, on_step=lambda step: stop.set() if step == 5 else None)

    run = runner.run_next_shard(engine=engine, stop=stop)

    assert run.end == runner.ShardEnd.HANDED_BACK and run.batch_status == BatchStatus.IN_PROGRESS
    assert not engine.has_unfinished_requests() and len(engine.aborted) == 8
    with session_scope() as session:
        batch = repository.get_batch(session, batch_id=batch_id)
        assert (batch.completed_requests, batch.failed_requests) == (4, 0)
        shard = session.get(BatchShard, run.shard_id)
        assert (shard.state, shard.attempts, shard.lease_token) == ("queued", 0, None)
    again = StandInEngine(served_tokenizer)
    assert run_batch(batch_id, engine=again) == BatchStatus.COMPLETED
    assert again.num_added == 8  # only the lines not finished before the stop
    _, output, errors = read_results(batch_id)
    assert len(output) == 12 and errors == {}


def test_an_exception_while_stopping_is_not_the_lines_failure(service, served_tokenizer):
    """Celery's cold shutdown used to raise out of the engine step: after a stop, that hands back too."""
    import threading

    batch_id = make_batch([completion(f"p{i}", max_tokens=4) for i in range(6)])
    stop = threading.Event()

    def interrupted(step: int) -> None:
        if step == 2:
            stop.set()
            raise NotImplementedError("terminate_job")  # what the solo pool raises on a cold shutdown

    run = runner.run_next_shard(engine=StandInEngine(served_tokenizer, on_step=interrupted), stop=stop)

    assert run.end == runner.ShardEnd.HANDED_BACK
    with session_scope() as session:
        batch = repository.get_batch(session, batch_id=batch_id)
        assert batch.failed_requests == 0 and batch.status == "in_progress"


def test_a_lost_lease_stops_the_run_and_leaves_the_shard_to_its_new_holder(service, served_tokenizer):
    from sqlalchemy import update

    from jobs.models import BatchShard

    batch_id = make_batch([completion(f"p{i}", max_tokens=4) for i in range(12)])

    def taken_over(step: int) -> None:
        if step == 5:
            with session_scope() as session:
                session.execute(update(BatchShard).values(lease_token="someone-else"))

    engine = StandInEngine(served_tokenizer, on_step=taken_over)
    run = runner.run_next_shard(engine=engine, check_every_steps=1)

    assert run.end == runner.ShardEnd.LEASE_LOST and not engine.has_unfinished_requests()
    with session_scope() as session:
        shard = session.get(BatchShard, run.shard_id)
        assert (shard.state, shard.lease_token) == ("running", "someone-else")
        assert repository.get_batch(session, batch_id=batch_id).failed_requests == 0


def _rows(batch_id: str) -> dict[str, tuple[list[int] | None, int]]:
    """custom_id -> (checkpoint_token_ids, recomputed_tokens) of every line."""
    from sqlalchemy import select

    from jobs.models import BatchRequest

    with session_scope() as session:
        query = select(BatchRequest.custom_id, BatchRequest.checkpoint_token_ids, BatchRequest.recomputed_tokens)
        return {
            custom_id: (ids, n) for custom_id, ids, n in session.execute(query.where(BatchRequest.batch_id == batch_id))
        }


def _counter(telemetry, name: str) -> float:
    return telemetry.metrics.registry.get_sample_value(f"batchinfer:{name}_total", {"model_name": "m"}) or 0.0


def test_a_handed_back_shard_checkpoints_its_lines_in_flight_and_the_next_run_resumes_them(service, served_tokenizer):
    """docs/operations.md, "Checkpoints": the generated token ids of lines in flight are saved at the hand-back;
    the next run adds them resuming from those (the stand-in goes on from them), a line asking for logprobs
    cannot resume: its tokens are counted as recomputed. Checkpoints are cleared once results are recorded."""
    import threading

    from worker.metrics import EngineMetrics
    from worker.telemetry import WorkerTelemetry

    bodies = [completion(f"p{i}", max_tokens=6) for i in range(3)] + [completion("lp", max_tokens=6, logprobs=1)]
    batch_id = make_batch(bodies)
    stop = threading.Event()
    engine = StandInEngine(served_tokenizer, on_step=lambda step: stop.set() if step == 3 else None)
    first = WorkerTelemetry(EngineMetrics("m"))

    run = runner.run_next_shard(engine=engine, stop=stop, observer=first)

    assert run.end == runner.ShardEnd.HANDED_BACK
    ok = engine.token_id
    rows = _rows(batch_id)  # 4 tokens each: the stop came during the 4th step
    assert rows == {"line-1": ([ok] * 4, 0), "line-2": ([ok] * 4, 0), "line-3": ([ok] * 4, 0), "line-4": (None, 4)}
    assert _counter(first, "recomputed_tokens") == 4

    again = StandInEngine(served_tokenizer)
    second = WorkerTelemetry(EngineMetrics("m"))
    assert run_batch(batch_id, engine=again, observer=second) == BatchStatus.COMPLETED

    ids = {custom_id: request_id for request_id, custom_id in _request_ids(batch_id).items()}
    assert again.resumed == {ids["line-1"]: 4, ids["line-2"]: 4, ids["line-3"]: 4, ids["line-4"]: 0}
    assert _counter(second, "resumed_tokens") == 12 and _counter(second, "generation_tokens") == 3 * 2 + 6
    _, output, errors = read_results(batch_id)
    assert errors == {} and len(output) == 4
    for entry in output.values():
        body = entry["response"]["body"]
        assert body["choices"][0]["text"] == " ok" * 6 and body["usage"]["completion_tokens"] == 6
    assert _rows(batch_id) == {"line-1": (None, 0), "line-2": (None, 0), "line-3": (None, 0), "line-4": (None, 4)}


def _request_ids(batch_id: str) -> dict[str, str]:
    from sqlalchemy import select

    from jobs.models import BatchRequest

    with session_scope() as session:
        query = select(BatchRequest.id, BatchRequest.custom_id).where(BatchRequest.batch_id == batch_id)
        return dict(session.execute(query).all())


def test_lines_are_checkpointed_as_they_run(service, served_tokenizer, monkeypatch):
    monkeypatch.setenv("BATCHINFER_CHECKPOINT_INTERVAL_S", "0.000001")
    get_settings.cache_clear()
    batch_id = make_batch([completion(f"p{i}", max_tokens=8) for i in range(2)])
    seen: list[int] = []

    def look(_step: int) -> None:
        seen.append(len(_rows(batch_id)["line-1"][0] or []))

    assert run_batch(batch_id, engine=StandInEngine(served_tokenizer, on_step=look)) == BatchStatus.COMPLETED

    assert seen == list(range(8)), seen  # before step k, the k tokens of the steps before are saved
    assert _rows(batch_id) == {"line-1": (None, 0), "line-2": (None, 0)}


def test_a_lost_lease_writes_no_checkpoint_and_counts_what_it_throws_away(service, served_tokenizer):
    from sqlalchemy import update

    from jobs.models import BatchShard
    from worker.metrics import EngineMetrics
    from worker.telemetry import WorkerTelemetry

    batch_id = make_batch([completion(f"p{i}", max_tokens=8) for i in range(2)])

    def taken_over(step: int) -> None:
        if step == 3:
            with session_scope() as session:
                session.execute(update(BatchShard).values(lease_token="someone-else"))

    telemetry = WorkerTelemetry(EngineMetrics("m"))
    run = runner.run_next_shard(
        engine=StandInEngine(served_tokenizer, on_step=taken_over), check_every_steps=1, observer=telemetry
    )

    assert run.end == runner.ShardEnd.LEASE_LOST
    assert _rows(batch_id) == {"line-1": (None, 0), "line-2": (None, 0)}
    assert _counter(telemetry, "recomputed_tokens") == 2 * 4
