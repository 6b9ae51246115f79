"""A model folder's config and tokenizer resolved once (worker/engine/model_files.py): a cached load gives
transformers' values and transformers' tokenizer on every served family, without importing the family's config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from tests.helpers.tiny_models import FAMILIES, save_tiny_bert, save_tiny_model
from worker.engine.model_files import cache_path, load_config, load_tokenizer

CORPUS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "naïve café, 東京, emoji 🙂 and a tab\there",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "def f(x):\n    return x ** 2  # code\n",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3? ünïcödé"},
]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    dirs = {family: save_tiny_model(root / family, family) for family in FAMILIES}
    dirs["bert"] = save_tiny_bert(root / "bert")
    return dirs


def _config_values(config: PretrainedConfig) -> dict[str, object]:
    return {**vars(config), "model_type": config.model_type}


def _assert_same_config(got: PretrainedConfig, expected: PretrainedConfig) -> None:
    assert _config_values(got) == _config_values(expected)
    for name, value in _config_values(expected).items():  # types too: 1 == 1.0 == True would pass above
        assert type(getattr(got, name)) is type(value), name


def _assert_same_tokenizer(got: PreTrainedTokenizerBase, expected: PreTrainedTokenizerBase) -> None:
    assert type(got) is type(expected)
    assert len(got) == len(expected)
    assert got.all_special_ids == expected.all_special_ids
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id) == (
        expected.bos_token_id,
        expected.eos_token_id,
        expected.pad_token_id,
    )
    assert got.convert_ids_to_tokens(list(range(len(expected)))) == expected.convert_ids_to_tokens(
        list(range(len(expected)))
    )
    for text in CORPUS:
        ids = expected.encode(text)
        assert got.encode(text) == ids, text
        assert got.encode(text, add_special_tokens=False) == expected.encode(text, add_special_tokens=False)
        assert got.decode(ids) == expected.decode(ids)
        assert got.decode(ids, skip_special_tokens=True) == expected.decode(ids, skip_special_tokens=True)
    assert got.chat_template == expected.chat_template
    if expected.chat_template is not None:
        for generation_prompt in (True, False):
            rendered = expected.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
            assert (
                got.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt) == rendered
            )


@pytest.mark.parametrize("family", [*FAMILIES, "bert"])
def test_a_cached_load_gives_transformers_config_and_tokenizer(tiny_dirs, tmp_path, family):
    model_dir, cache = tiny_dirs[family], tmp_path / "cache"
    expected_config, expected_tokenizer = (
        AutoConfig.from_pretrained(model_dir),
        AutoTokenizer.from_pretrained(model_dir),
    )

    first_config, first_tokenizer = load_config(model_dir, cache), load_tokenizer(model_dir, cache)
    assert cache_path(cache, model_dir).is_file()
    cached_config, cached_tokenizer = load_config(model_dir, cache), load_tokenizer(model_dir, cache)

    for config in (first_config, cached_config):
        _assert_same_config(config, expected_config)
    for tokenizer in (first_tokenizer, cached_tokenizer):
        _assert_same_tokenizer(tokenizer, expected_tokenizer)


@pytest.mark.slow
def test_the_served_model_loads_the_same_from_the_cache(served_model_dir, served_tokenizer, tmp_path):
    load_config(served_model_dir, tmp_path), load_tokenizer(served_model_dir, tmp_path)
    _assert_same_config(load_config(served_model_dir, tmp_path), AutoConfig.from_pretrained(served_model_dir))
    _assert_same_tokenizer(load_tokenizer(served_model_dir, tmp_path), served_tokenizer)


def test_a_cached_load_imports_no_family_config(tiny_dirs, tmp_path):
    """The point of the cache: transformers' family config modules (and the import chain under them) stay unloaded."""
    model_dir, cache = tiny_dirs["llama"], tmp_path / "cache"
    load_config(model_dir, cache), load_tokenizer(model_dir, cache)
    code = (
        "import sys; from worker.engine.model_files import load_config, load_tokenizer; "
        f"c = load_config({str(model_dir)!r}, {str(cache)!r}); t = load_tokenizer({str(model_dir)!r}, {str(cache)!r}); "
        "print(c.model_type, sorted(m for m in sys.modules if m.startswith('transformers.models.llama') "
        "or m == 'torch.distributed.tensor'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "llama []"


def test_a_changed_config_or_an_unreadable_cache_resolves_again(tiny_dirs, tmp_path, caplog):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for path in tiny_dirs["llama"].iterdir():
        (model_dir / path.name).write_bytes(path.read_bytes())
    cache = tmp_path / "cache"
    load_config(model_dir, cache)
    first = cache_path(cache, model_dir)
    first.write_text("{not json")
    assert load_config(model_dir, cache).model_type == "llama"
    assert "did not load" in caplog.text

    config_file = model_dir / "config.json"
    config_file.write_text(config_file.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert cache_path(cache, model_dir) != first
    assert load_config(model_dir, cache).rms_norm_eps == 1e-5
    assert load_config(model_dir, cache).rms_norm_eps == 1e-5  # from the new file


def test_no_cache_dir_resolves_every_time(tiny_dirs):
    config = load_config(tiny_dirs["qwen2"])
    assert type(config).__name__ == "Qwen2Config"
    assert type(load_tokenizer(tiny_dirs["qwen2"])) is type(AutoTokenizer.from_pretrained(tiny_dirs["qwen2"]))
