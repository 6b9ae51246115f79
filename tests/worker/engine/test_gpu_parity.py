"""The engine on CUDA (attention through the Triton kernels) against Hugging Face on the real SmolLM2-135M-Instruct.

Opt-in (``gpu`` marker; ``scripts/gpu_check.sh`` runs it). float32: references from HF in float32 on the CPU and
the project's near-tie rule. bfloat16: references from HF in bfloat16 on the same GPU; bfloat16 logits carry
about 1e-2 of relative noise, so a divergence counts as a near-tie up to ``BF16_NEAR_TIE_TOL``.
"""

import pytest
import torch
import transformers

from tests.helpers.parity import assert_greedy_close, chat_prompt_ids, hf_greedy_reference
from worker.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_TOKENS = 24
BF16_NEAR_TIE_TOL = 0.1
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Why is the sky blue? Answer briefly, for a child of seven who asked at breakfast.",
]


@pytest.fixture(scope="module")
def prompts(served_tokenizer):
    return chat_prompt_ids(served_tokenizer, QUESTIONS)


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", BF16_NEAR_TIE_TOL)])
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 32])  # whole prompts, and chunked (extend rows)
def test_engine_on_cuda_matches_hugging_face(served_model_dir, prompts, dtype, tol, max_num_batched_tokens):
    torch_dtype = getattr(torch, dtype)
    hf_device = "cpu" if dtype == "float32" else "cuda"
    hf_model = transformers.LlamaForCausalLM.from_pretrained(served_model_dir, dtype=torch_dtype).to(hf_device).eval()
    references = [hf_greedy_reference(hf_model, prompt, MAX_TOKENS) for prompt in prompts]
    engine = LLMEngine(
        EngineConfig(
            model=str(served_model_dir),
            device="cuda",
            dtype=dtype,
            kv_cache_memory_bytes=256 << 20,
            max_model_len=512,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    )
    assert engine.model_runner.use_triton_kernels
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for i, (ref, out) in enumerate(zip(references, outputs)):
        assert_greedy_close(ref.token_ids, ref.top2, out.outputs[0].token_ids, tol=tol, label=f"{dtype} prompt {i}")
