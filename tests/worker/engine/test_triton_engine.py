"""The engine with every attention row on the Triton kernels (as on CUDA), run here through Triton's interpreter
(natively where CUDA is available) on a tiny random GQA Llama: greedy parity with Hugging Face under chunked
prefill and prefix caching, and copy-on-write forks giving the same samples as the PyTorch paths."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.7.1, the `test` extra)")

from tests.helpers.parity import assert_greedy_close, hf_greedy_reference
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.executor import model_runner

MAX_TOKENS = 6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def prompts():
    rng = random.Random(1)
    shared = [rng.randrange(3, 259) for _ in range(9)]
    return [[rng.randrange(3, 259) for _ in range(n)] for n in (1, 13)] + [shared + [7], shared + [8, 9]]


def make_engine(model_dir, **overrides):
    fields = dict(model=str(model_dir), block_size=4, kv_cache_memory_bytes=1 << 22, max_model_len=64, device=DEVICE)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))


def test_greedy_through_triton_matches_hugging_face(monkeypatch, model_dir, hf_model, prompts):
    torch.set_num_threads(1)
    monkeypatch.setattr(model_runner, "triton_kernels_apply", lambda device: True)
    engine = make_engine(model_dir, max_num_batched_tokens=8, enable_prefix_caching=True)
    assert engine.model_runner.use_triton_kernels
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ref = hf_greedy_reference(hf_model, prompt, MAX_TOKENS)
        assert_greedy_close(ref.token_ids, ref.top2, out.outputs[0].token_ids, label=f"prompt {i}")


def test_forks_through_triton_sample_as_the_pytorch_paths(monkeypatch, model_dir, prompts):
    torch.set_num_threads(1)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    monkeypatch.setattr(model_runner, "triton_kernels_apply", lambda device: False)
    expected = make_engine(model_dir).generate(prompts[1:2], params)
    monkeypatch.setattr(model_runner, "triton_kernels_apply", lambda device: True)
    calls = []
    copy_blocks_triton = pytest.importorskip("kernels.triton_attention").copy_blocks_triton
    monkeypatch.setattr(
        "kernels.triton_attention.copy_blocks_triton",
        lambda *args: (calls.append(1), copy_blocks_triton(*args)),
    )
    outputs = make_engine(model_dir).generate(prompts[1:2], params)
    assert calls, "no copy-on-write went through the Triton block copy"
    assert [c.token_ids for c in outputs[0].outputs] == [c.token_ids for c in expected[0].outputs]
