"""Every supported family (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) through the whole engine
against Hugging Face.

Tiny random checkpoints built with transformers' own classes (``tests/helpers/tiny_models.py``), stored
in fp32 and in bf16 (the engine runs fp32; HF runs the same bf16 weights upcast to fp32): greedy ids
equal to HF ``generate`` under the near-tie rule, with chunked prefill and prefix caching on, and the
returned logprobs within 1e-4 of HF's log-softmax. The same with sliding windows shorter than the
prompts (docs/engine.md, "Sliding-window attention"), and the blocks behind the window returned to the
pool. Plus the registry's refusals and sharded loading.
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
from worker.engine.executor import model_runner as runner_module
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


def _hf_logits(hf_model, prompt, output_ids):
    """HF's logits at every generated position, as its ``generate`` computed them: one forward over the whole
    sequence, except under Phi-3's ``longrope``, where a position's logits come from a call over a sequence of
    ``max(len(prompt), position + 1)`` tokens, with the short factors when that is within the limit."""
    tokens = torch.tensor([prompt + output_ids[:-1]])
    with torch.inference_mode():
        logits = hf_model(tokens).logits[0]
        rope = getattr(hf_model.config, "rope_parameters", None) or {}
        if rope.get("rope_type") == "longrope" and len(prompt) <= rope["original_max_position_embeddings"]:
            limit = rope["original_max_position_embeddings"]
            logits[:limit] = hf_model(tokens[:, :limit]).logits[0]
    return logits[len(prompt) - 1 :]


def _check_engine_against_hugging_face(path, family, prompts, engine_config=None):
    """Cold and warm (prefix-cached) greedy runs of ``prompts`` with chunked prefill: HF's ids (near-tie
    rule) and logprobs within 1e-4. Returns the engine."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf_model) is FAMILIES[family][1]
    engine = LLMEngine(
        engine_config
        or EngineConfig(model=str(path), max_model_len=64, max_num_batched_tokens=12, kv_cache_memory_bytes=4 << 20)
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
        hf_logprobs = torch.log_softmax(_hf_logits(hf_model, prompt, out.token_ids).float(), dim=-1)
        assert out.logprobs is not None
        for pos, (token_id, position) in enumerate(zip(out.token_ids, out.logprobs)):
            assert position[token_id].logprob == pytest.approx(float(hf_logprobs[pos, token_id]), abs=1e-4)
    return engine


@pytest.mark.parametrize("stored_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral", "phi3", "qwen2", "qwen3"])
def test_engine_matches_hugging_face(tmp_path, family, stored_dtype):
    path = save_tiny_model(tmp_path, family, seed=3, dtype=stored_dtype)
    _check_engine_against_hugging_face(path, family, _prompts(seed=len(family)))


# Windows shorter than the longer prompts (30 + 10 generated tokens), not multiples of the block size (8).
SLIDING_WINDOW = 11
SLIDING = {
    "mistral": {"sliding_window": SLIDING_WINDOW},  # every layer
    "qwen2": {"use_sliding_window": True, "sliding_window": SLIDING_WINDOW, "max_window_layers": 1},  # layer 1
    "gemma2": {"sliding_window": SLIDING_WINDOW},  # layer 0 local, layer 1 global, soft-capped
    # Hugging Face's Gemma 3 ignores attn_logit_softcapping, and so must the engine.
    "gemma3": {"sliding_window": SLIDING_WINDOW, "attn_logit_softcapping": 3.0},
}


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_matches_hugging_face(tmp_path, family):
    """Prompts longer than the window, chunked (12-token budget) and prefix-cached: each local layer sees its
    last ``sliding_window`` positions exactly as Hugging Face's mask does."""
    path = save_tiny_model(tmp_path, family, seed=5, **SLIDING[family])

    engine = _check_engine_against_hugging_face(path, family, _prompts(seed=7))

    model = engine.model_runner.model
    expected_windows = {
        "mistral": [SLIDING_WINDOW] * 2,
        "qwen2": [None, SLIDING_WINDOW],
        "gemma2": [SLIDING_WINDOW, None],
        "gemma3": [SLIDING_WINDOW, None],
    }[family]
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == expected_windows
    # Only a model whose every layer is windowed lets the KV cache manager free blocks.
    assert engine.kv_cache_manager.sliding_window == (SLIDING_WINDOW if family == "mistral" else None)


def test_blocks_behind_the_window_go_back_to_the_pool(tmp_path):
    """Mistral (every layer windowed): while a 40-token sequence decodes, it holds only the blocks its next
    token can see (plus the null block's stand-ins), and the pool's free count says so at every step."""
    path = save_tiny_model(tmp_path, "mistral", seed=5, sliding_window=SLIDING_WINDOW)
    engine = LLMEngine(
        EngineConfig(model=str(path), max_model_len=64, max_num_batched_tokens=12, num_gpu_blocks_override=20)
    )
    kv = engine.kv_cache_manager
    prompt = _prompts(seed=7)[3]  # 30 tokens
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    num_live_at_decode = []
    while engine.has_unfinished_requests():
        engine.step()
        kv.check_invariants()
        if not kv.seq_to_blocks:  # finished: all its blocks are back
            break
        [(seq_id, blocks)] = kv.seq_to_blocks.items()
        live = [block for block in blocks if block is not kv.null_block]
        assert kv.num_free_blocks == 20 - 1 - len(live)  # the null block and the live ones are taken
        if kv._seqs[seq_id].num_computed_tokens > len(prompt):  # decoding: one token past the last step's
            num_live_at_decode.append(len(live))
    # A decode token sees 11 positions: they span at most 3 blocks of 8, of the 5 the 40 tokens fill.
    assert num_live_at_decode and max(num_live_at_decode) <= 3
    assert kv.num_free_blocks == 19


def test_sliding_window_with_contexts_within_the_window_uses_the_global_plan(tmp_path, monkeypatch):
    """Steps whose contexts all fit in the window give their local layers the global plan (nothing else built)."""
    path = save_tiny_model(tmp_path, "gemma2", sliding_window=64)
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=64, kv_cache_memory_bytes=1 << 20))
    built = []
    build = runner_module.build_attention_metadata

    def spy(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(runner_module, "build_attention_metadata", spy)
    engine.generate([_prompts(seed=1)[1]], SamplingParams(temperature=0, max_tokens=3))

    assert built and all(m.sliding_plan is m.plan and m.sliding_window == 64 for m in built)


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
        UnsupportedModelError,
        match=r"MambaForCausalLM.*supported: Gemma2ForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM",
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
        UnsupportedModelError, match=r"none listed; model_type 'gpt2'.*supported: Gemma2ForCausalLM, Gemma3ForCausalLM"
    ):
        load_model(tmp_path / "gpt2", torch.float32, "cpu")


def test_phi3_longrope_matches_hugging_face(tmp_path):
    """``longrope`` with a pretraining context of 24: the 30-token prompt takes the long factors throughout,
    the 21-token one switches to them at position 24 while it generates, the short ones never do. The
    30- and 21-token prompts share their first 16 tokens, but not their cached blocks (their K differ);
    chunked prefill (12-token budget) and the prefix-cached second run must not change any of it."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,  # 8 rotated channels: 4 factors
        "short_factor": [1.0, 1.1, 1.3, 1.6],
        "long_factor": [1.0, 2.0, 6.0, 20.0],
        "original_max_position_embeddings": 24,
    }
    path = save_tiny_model(tmp_path, "phi3", seed=4, rope_parameters=rope, original_max_position_embeddings=24)
    prompts = _prompts(seed=9)
    assert [len(p) for p in prompts] == PROMPT_LENS and prompts[1][:16] == prompts[3][:16]

    engine = _check_engine_against_hugging_face(path, "phi3", prompts)

    assert engine.kv_cache_manager.long_rope_len == 24
    rotary = engine.model_runner.model.model.layers[0].self_attn.rotary_emb
    assert rotary.long_rope_offset == 512 and rotary.cos.shape[0] == 2 * 512
