"""``batchinfer heads train`` end to end on the tiny model: prompt files in, heads out, resumable."""

from __future__ import annotations

import json

import torch

from tests.helpers.tiny_llama import save_tiny_llama
from worker import cli
from worker.cli_heads import DATA_FILE
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.spec_decode.heads.train import STATE_FILE


def test_train_writes_heads_the_engine_loads_and_resumes(tmp_path, capsys):
    model_dir = save_tiny_llama(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"custom_id": "a", "url": "/v1/completions", "body": {"model": "m", "prompt": "skipped"}},
        {"custom_id": "b", "url": "/v1/completions", "body": {"model": "m", "prompt": "def add(a, b):"}},
        {
            "custom_id": "c",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "Say hello."}]},
        },
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = [
        "heads",
        "train",
        "--method",
        "medusa",
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--skip-prompts",
        "1",
        "--max-tokens",
        "12",
        "--batch-size",
        "2",
    ]
    assert cli.main([*argv, "--steps", "3"]) == 0
    out_dir = model_dir / "heads" / "medusa"
    assert capsys.readouterr().out.strip() == str(out_dir)
    assert len(torch.load(out_dir / DATA_FILE)) == 2  # the skipped line is not used
    assert cli.main([*argv, "--steps", "5"]) == 0  # resumes at step 3 on the cached text
    assert "2 cached sequences" in capsys.readouterr().err
    assert torch.load(out_dir / STATE_FILE, weights_only=False)["step"] == 5
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), kv_cache_memory_bytes=8 << 20, speculative_mode="on", speculative_method="medusa"
        )
    )
    output = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(output.outputs[0].token_ids) == 8 and engine.make_stats().num_drafts > 0
