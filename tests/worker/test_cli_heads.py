"""``batchinfer heads train`` end to end on the tiny model: prompt files in, heads out, resumable."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig

from tests.helpers.tiny_llama import save_tiny_llama
from worker import cli
from worker.cli_heads import DATA_FILE, database_sequences, kv_budget_bytes
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.spec_decode.heads.storage import DRAFT_VOCAB_FILE, load_head
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
    assert cli.main([*argv, "--steps", "3", "--snapshot-at", "2"]) == 0
    out_dir = model_dir / "heads" / "medusa"
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out_dir)
    # Each phase reports its CPU time.
    for phase in ("generation: ", "feature pass: ", "training: steps 1-3"):
        assert re.search(phase + r".* in \d+\.\d CPU-s", captured.err), phase
    hidden = int(AutoConfig.from_pretrained(model_dir).hidden_size)
    snapshot, final = (
        load_head(folder, hidden_size=hidden, dtype=torch.float32, device="cpu")
        for folder in (out_dir / "step-2", out_dir)
    )
    assert (out_dir / "step-2" / DRAFT_VOCAB_FILE).is_file()
    assert any(not torch.equal(a, b) for a, b in zip(snapshot.state_dict().values(), final.state_dict().values()))
    assert len(torch.load(out_dir / DATA_FILE)) == 2  # the skipped line is not used
    assert cli.main([*argv, "--steps", "5"]) == 0  # resumes at step 3 on the cached text
    assert "2 cached sequences" in capsys.readouterr().err
    assert torch.load(out_dir / STATE_FILE, weights_only=False)["step"] == 5
    # The other method's run in the same folder is refused in one line, not a traceback.
    with pytest.raises(SystemExit, match=r"^batchinfer heads train: .*train_state\.pt holds a medusa run, not eagle$"):
        cli.main([*argv[:2], "--method", "eagle", *argv[4:], "--steps", "6", "--out", str(out_dir)])
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), kv_cache_memory_bytes=8 << 20, speculative_mode="on", speculative_method="medusa"
        )
    )
    output = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(output.outputs[0].token_ids) == 8 and engine.make_stats().num_drafts > 0


def test_kv_budget_holds_every_line_at_once(tmp_path):
    """The data generation's KV budget runs all prompts as one batch without preemption; a third of it cannot."""
    model_dir = save_tiny_llama(tmp_path / "model")
    prompts = [[5 + i, 6, 7, 8] * (1 + i % 3) for i in range(12)]
    max_tokens = 24
    lengths = [len(prompt) + max_tokens for prompt in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    preemptions = []
    for budget in (kv_budget_bytes(model_dir, lengths, 8), kv_budget_bytes(model_dir, lengths, 8) // 3):
        config = EngineConfig(
            model=str(model_dir),
            kv_cache_memory_bytes=budget,
            block_size=8,
            max_num_seqs=12,
            max_model_len=max(lengths),
        )
        engine = LLMEngine(config)
        engine.generate([list(prompt) for prompt in prompts], params)
        preemptions.append(engine.make_stats().num_preemptions)
    assert preemptions[0] == 0 and preemptions[1] > 0


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--steps", "-1", "must be 0 or more, got -1"),
        ("--skip-prompts", "-1", "must be 0 or more, got -1"),
        ("--draft-vocab-size", "-8", "must be 0 or more, got -8"),
        ("--lr", "0", "must be above 0, got 0"),
        ("--lr", "nan", "must be a finite number"),
        ("--ce-weight", "-0.5", "must be 0 or more, got -0.5"),
        ("--ce-weight", "x", "must be a number, got 'x'"),
        ("--method", "hydra", "invalid choice: 'hydra'"),
    ],
)
def test_bad_option_values_are_refused_naming_the_option(option, value, message, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["heads", "train", option, value])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {option}: {message}" in error


def test_an_unknown_model_is_one_line(tmp_path):
    with pytest.raises(
        SystemExit, match=r"^batchinfer heads train: model .*nowhere.* nor a folder containing config\.json$"
    ):
        cli.main(["heads", "train", "--model", str(tmp_path / "nowhere")])


def test_from_db_on_a_database_without_tables_is_one_line(tmp_path, monkeypatch):
    from jobs.config import get_settings
    from jobs.db import dispose_engines

    monkeypatch.setenv("BATCHINFER_DATABASE_URL", f"sqlite:///{tmp_path / 'never-upgraded.db'}")
    get_settings.cache_clear()
    try:
        with pytest.raises(SystemExit, match=r"--from-db cannot read the database .*batchinfer db upgrade"):
            database_sequences("m", None, 4)
    finally:
        dispose_engines()
        get_settings.cache_clear()
