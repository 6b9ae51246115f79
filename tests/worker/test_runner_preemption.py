"""The runner on the real engine (the built-in SmolLM2) with a KV cache too small for its lines: the engine preempts
by recompute, and a preemption throws away no generated token, so ``batchinfer:recomputed_tokens_total`` (generated
tokens an interrupted line threw away, `worker.checkpointer`) stays 0 while ``num_preemptions_total`` counts them
(docs/architecture.md, "Observability")."""

from __future__ import annotations

from jobs.status import BatchStatus
from tests.helpers.stand_in_engine import run_batch
from tests.worker.test_runner import completion, make_batch, read_results, service  # noqa: F401  (fixture)
from worker.engine import EngineConfig, LLMEngine
from worker.metrics import EngineMetrics
from worker.telemetry import WorkerTelemetry

MAX_TOKENS = 24


def _counter(telemetry: WorkerTelemetry, name: str) -> float:
    return telemetry.metrics.registry.get_sample_value(f"batchinfer:{name}_total", {"model_name": "m"}) or 0.0


def test_preempted_lines_recompute_their_kv_and_throw_away_no_generated_token(service, served_model_dir):
    # 8 blocks of 8 tokens (one 64-token sequence) for 4 lines of ~10 prompt + 24 generated tokens each.
    engine = LLMEngine(EngineConfig(model=str(served_model_dir), num_gpu_blocks_override=8, max_model_len=64))
    bodies = [completion(f"def f{i}(x):\n", max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(4)]
    batch_id = make_batch(bodies)
    telemetry = WorkerTelemetry(EngineMetrics("m"))

    assert run_batch(batch_id, engine=engine, observer=telemetry) == BatchStatus.COMPLETED

    _, output, errors = read_results(batch_id)
    assert errors == {} and len(output) == 4
    assert all(entry["response"]["body"]["usage"]["completion_tokens"] == MAX_TOKENS for entry in output.values())
    assert _counter(telemetry, "num_preemptions") > 0
    # every token was sampled once: a preempted line kept its generated tokens and recomputed only their KV
    assert _counter(telemetry, "generation_tokens") == 4 * MAX_TOKENS
    assert _counter(telemetry, "recomputed_tokens") == 0
