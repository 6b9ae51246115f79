"""Every supported family (Llama, Mistral, Qwen2, Qwen3) through the whole engine against Hugging Face.

Tiny random checkpoints built with transformers' own classes (``tests/helpers/tiny_models.py``), stored
in fp32 and in bf16 (the engine runs fp32; HF runs the same bf16 weights upcast to fp32): greedy ids
equal to HF ``generate`` under the near-tie rule, with chunked prefill and prefix caching on, and the
returned logprobs within 1e-4 of HF's log-softmax. Plus the registry's refusals and sharded loading.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from tests.helpers.parity import assert_greedy_close, hf_greedy_reference
from tests.helpers.tiny_models import FAMILIES, save_tiny_model
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.executor.model_loader import load_model
from worker.engine.executor.models import MODEL_ARCHITECTURES, UnsupportedModelError

MAX_TOKENS = 10
PROMPT_LENS = [3, 21, 9, 30]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 259) for _ in range(16)]  # two prompts share two 8-token blocks
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in PROMPT_LENS]
    prompts[1][:16] = shared
    prompts[3][:16] = shared
    return prompts


@pytest.mark.parametrize("stored_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gemma3", "mistral", "phi3", "qwen2", "qwen3"])
def test_engine_matches_hugging_face(tmp_path, family, stored_dtype):
    path = save_tiny_model(tmp_path, family, seed=3, dtype=stored_dtype)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf_model) is FAMILIES[family][1]
    prompts = _prompts(seed=len(family))
    engine = LLMEngine(
        EngineConfig(model=str(path), max_model_len=64, max_num_batched_tokens=12, kv_cache_memory_bytes=4 << 20)
    )
    assert type(engine.model_runner.model).__name__ == FAMILIES[family][1].__name__.replace("Mistral", "Llama")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)

    cold = engine.generate(prompts, params)
    warm = engine.generate(prompts, params)

    assert engine.make_stats().num_cached_tokens > 0
    for i, (prompt, cold_out, warm_out) in enumerate(zip(prompts, cold, warm)):
        out = cold_out.outputs[0]
        assert warm_out.outputs[0].token_ids == out.token_ids
        reference = hf_greedy_reference(hf_model, prompt, MAX_TOKENS)
        assert_greedy_close(reference.token_ids, reference.top2, out.token_ids, label=f"{family} prompt {i}")
        with torch.inference_mode():
            hf_logits = hf_model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
        hf_logprobs = torch.log_softmax(hf_logits.float(), dim=-1)
        assert out.logprobs is not None
        for pos, (token_id, position) in enumerate(zip(out.token_ids, out.logprobs)):
            assert position[token_id].logprob == pytest.approx(float(hf_logprobs[pos, token_id]), abs=1e-4)


def test_sharded_bf16_checkpoint_loads_like_the_single_file(tmp_path):
    single = load_model(save_tiny_model(tmp_path / "one", "qwen3", dtype=torch.bfloat16), torch.float32, "cpu")
    sharded_dir = save_tiny_model(tmp_path / "shards", "qwen3", dtype=torch.bfloat16, max_shard_size="40KB")
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    (sharded_dir / "consolidated.safetensors").write_bytes(b"not listed in the index, never opened")

    sharded = load_model(sharded_dir, torch.float32, "cpu")

    single_state, sharded_state = single.state_dict(), sharded.state_dict()
    assert single_state.keys() == sharded_state.keys()
    for name, tensor in single_state.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, sharded_state[name]), name


def test_qwen3_q_k_norms_are_loaded(tmp_path):
    path = save_tiny_model(tmp_path, "qwen3")
    hf_model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)

    model = load_model(path, torch.float32, "cpu")

    attn = model.model.layers[1].self_attn
    assert attn.head_size == 32 and attn.q_norm is not None and attn.k_norm is not None
    assert torch.equal(attn.k_norm.weight, hf_model.model.layers[1].self_attn.k_norm.weight)


def _set_architectures(path, architectures):
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = architectures
    config_path.write_text(json.dumps(config))


def test_unsupported_architecture_fails_at_start_up_naming_what_is_supported(tmp_path):
    path = save_tiny_model(tmp_path, "llama")
    _set_architectures(path, ["MambaForCausalLM"])

    with pytest.raises(
        UnsupportedModelError, match=r"MambaForCausalLM.*supported: Gemma3ForCausalLM, LlamaForCausalLM"
    ) as info:
        LLMEngine(EngineConfig(model=str(path), max_model_len=64, kv_cache_memory_bytes=1 << 20))

    assert all(name in str(info.value) for name in MODEL_ARCHITECTURES)


def test_config_without_architectures_is_resolved_by_model_type(tmp_path):
    """transformers writes no ``architectures`` when it converts a GGUF (the built-in model's folder)."""
    path = save_tiny_model(tmp_path / "qwen2", "qwen2")
    _set_architectures(path, None)
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "gpt2")

    assert type(load_model(path, torch.float32, "cpu")).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(
        UnsupportedModelError, match=r"none listed; model_type 'gpt2'.*supported: Gemma3ForCausalLM, Llama"
    ):
        load_model(tmp_path / "gpt2", torch.float32, "cpu")


def test_mistral_sliding_window_shorter_than_max_model_len_is_refused(tmp_path):
    path = save_tiny_model(tmp_path, "mistral", sliding_window=32)

    with pytest.raises(UnsupportedModelError, match="sliding_window=32, below max_model_len=64"):
        LLMEngine(EngineConfig(model=str(path), max_model_len=64, kv_cache_memory_bytes=1 << 20))
    with pytest.raises(UnsupportedModelError, match="max_model_len=512"):
        load_model(path, torch.float32, "cpu")  # default max_model_len: max_position_embeddings
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=32, kv_cache_memory_bytes=1 << 20))
    assert engine.max_model_len == 32


def test_qwen2_sliding_window_applies_only_when_a_layer_uses_it(tmp_path):
    unused = save_tiny_model(
        tmp_path / "unused", "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2
    )
    used = save_tiny_model(tmp_path / "used", "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)

    load_model(unused, torch.float32, "cpu", max_model_len=64)
    with pytest.raises(UnsupportedModelError, match="sliding_window=16"):
        load_model(used, torch.float32, "cpu", max_model_len=64)


def test_phi3_longrope_is_refused_at_start_up(tmp_path):
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 128,
    }
    path = save_tiny_model(tmp_path, "phi3", rope_parameters=rope, original_max_position_embeddings=128)

    with pytest.raises(ValueError, match="longrope rope scaling is not supported"):
        LLMEngine(EngineConfig(model=str(path), max_model_len=64, kv_cache_memory_bytes=1 << 20))


def test_gemma3_attention_soft_capping_is_refused_at_start_up(tmp_path):
    path = save_tiny_model(tmp_path, "gemma3", attn_logit_softcapping=50.0)

    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        LLMEngine(EngineConfig(model=str(path), max_model_len=64, kv_cache_memory_bytes=1 << 20))


def test_gemma3_sliding_layers_need_max_model_len_within_the_window(tmp_path):
    path = save_tiny_model(tmp_path, "gemma3", sliding_window=48)

    with pytest.raises(UnsupportedModelError, match="sliding_window=48, below max_model_len=64"):
        load_model(path, torch.float32, "cpu", max_model_len=64)
    assert type(load_model(path, torch.float32, "cpu", max_model_len=48)).__name__ == "Gemma3ForCausalLM"
