"""Draft heads for the tiny test model: trained briefly on its own greedy outputs, or left random."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.executor.model_loader import load_model
from worker.engine.spec_decode.heads.storage import default_heads_dir, save_head
from worker.engine.spec_decode.heads.train import (
    TrainConfig,
    TrainResult,
    new_head,
    target_features,
    target_weights,
    train_heads,
)

TRAIN_PROMPTS = [[10] * 12, [5, 6, 7, 8, 9] * 2, list(range(3, 20)), [61] * 6, list(range(40, 60)), [30, 31] * 5]


def tiny_training_data(model_dir: Path, max_tokens: int = 48):
    """The tiny model's features over its own greedy continuations of :data:`TRAIN_PROMPTS`."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_bytes=8 << 20))
    outputs = engine.generate(TRAIN_PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    sequences = [prompt + list(out.outputs[0].token_ids) for prompt, out in zip(TRAIN_PROMPTS, outputs)]
    model = load_model(model_dir, torch.float32, "cpu")
    return model, target_features(model, sequences)


def train_tiny_heads(
    model_dir: Path, method: str, num_steps: int, out_dir: Path | None = None, on_step=None
) -> TrainResult:
    """Train ``method``'s heads on the tiny model for ``num_steps`` into ``<model>/heads/<method>`` (or ``out_dir``)."""
    model, data = tiny_training_data(model_dir)
    embed, lm_head = target_weights(model_dir, model)
    config = TrainConfig(method=method, num_steps=num_steps, lr=3e-3, warmup_steps=5, checkpoint_every=10)
    return train_heads(
        data,
        target_config=model.config,
        embed_weight=embed,
        lm_head_weight=lm_head,
        out_dir=out_dir or default_heads_dir(model_dir, method),
        config=config,
        on_step=on_step,
    )


def save_random_heads(model_dir: Path, seed: int = 0) -> None:
    """Untrained EAGLE and Medusa heads (random EAGLE layer; random Medusa blocks) beside ``model_dir``'s model."""
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    eagle = new_head("eagle", config, TrainConfig())
    medusa = new_head("medusa", config, TrainConfig(num_medusa_heads=4))
    for param in medusa.parameters():
        torch.nn.init.normal_(param, std=0.05)
    save_head(eagle, default_heads_dir(model_dir, "eagle"))
    save_head(medusa, default_heads_dir(model_dir, "medusa"))
