"""Draft heads: EAGLE / Medusa modules, their storage (ours and the published layouts), and self-distillation
(docs/engine.md, "Speculative decoding")."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from tests.helpers.tiny_heads import train_tiny_heads
from tests.helpers.tiny_llama import save_tiny_llama
from worker.engine.spec_decode.heads.eagle import EagleHead, EagleHeadConfig
from worker.engine.spec_decode.heads.medusa import MedusaHeads
from worker.engine.spec_decode.heads.storage import load_head, save_head
from worker.engine.spec_decode.heads.train import STATE_FILE, depth_two_visible

HIDDEN = 64


def _eagle(seed=0):
    torch.manual_seed(seed)
    config = EagleHeadConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    return EagleHead(config).eval()


def _eagle_out(head, seed=1):
    torch.manual_seed(seed)
    features, embeds = torch.randn(7, HIDDEN), torch.randn(7, HIDDEN)
    return head(features, embeds, torch.arange(7))[0]


def test_eagle_incremental_matches_full_sequence():
    """One position at a time with the returned K/V gives the rows of one call over the whole sequence."""
    head = _eagle()
    torch.manual_seed(1)
    features, embeds = torch.randn(7, HIDDEN), torch.randn(7, HIDDEN)
    full, _ = head(features, embeds, torch.arange(7))
    out, past = head(features[:3], embeds[:3], torch.arange(3))
    rows = [out]
    for p in range(3, 7):
        out, past = head(features[p : p + 1], embeds[p : p + 1], torch.tensor([p]), past)
        rows.append(out)
    torch.testing.assert_close(torch.cat(rows), full, atol=1e-5, rtol=1e-5)


def test_training_time_test_rows_are_depth_two_drafts():
    """The second training pass (depth_two_visible) computes what drafting computes at depth 2: the head over its
    own predicted feature, attending the committed entries before it."""
    torch.manual_seed(0)
    head = EagleHead(
        EagleHeadConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    ).eval()
    length = 10
    features, embeds = torch.randn(length, 32), torch.randn(length, 32)
    num = length - 1
    pred, kv = head(features[:num], embeds[1:], torch.arange(num))
    second, _ = head(pred[:-1], embeds[2:], torch.arange(1, num), kv, depth_two_visible(num))
    for q in range(1, num):
        draft, _ = head(pred[q - 1 : q], embeds[q + 1 : q + 2], torch.tensor([q]), (kv[0][:, :q], kv[1][:, :q]))
        torch.testing.assert_close(second[q - 1 : q], draft, atol=1e-5, rtol=1e-5)


def test_eagle_and_medusa_round_trip(tmp_path):
    eagle = _eagle()
    loaded = load_head(save_head(eagle, tmp_path / "eagle"), hidden_size=HIDDEN, dtype=torch.float32, device="cpu")
    assert isinstance(loaded, EagleHead)
    torch.testing.assert_close(_eagle_out(loaded), _eagle_out(eagle))
    medusa = MedusaHeads(HIDDEN, 3, 2)
    for param in medusa.parameters():
        torch.nn.init.normal_(param)
    loaded = load_head(save_head(medusa, tmp_path / "medusa"), hidden_size=HIDDEN, dtype=torch.float32, device="cpu")
    assert isinstance(loaded, MedusaHeads) and (loaded.num_heads, loaded.num_layers) == (3, 2)
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(loaded(x), medusa(x))


def test_published_eagle_layout_loads(tmp_path):
    """A ``yuhuili/EAGLE-*`` folder: a Llama ``config.json`` and ``pytorch_model.bin`` with the target's embedding."""
    eagle = _eagle()
    state = dict(eagle.state_dict())
    state["embed_tokens.weight"] = torch.randn(259, HIDDEN)
    torch.save(state, tmp_path / "pytorch_model.bin")
    llama_config = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=259,
    )
    (tmp_path / "config.json").write_text(json.dumps(llama_config))
    loaded = load_head(tmp_path, hidden_size=HIDDEN, dtype=torch.float32, device="cpu")
    torch.testing.assert_close(_eagle_out(loaded), _eagle_out(eagle))


@pytest.mark.parametrize("file_name", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_published_medusa_layout_loads_with_its_own_lm_heads(tmp_path, file_name):
    """Medusa-1 checkpoints: one vocabulary projection per head, keys with or without ``medusa_head.``."""
    medusa = MedusaHeads(HIDDEN, 2, 1, vocab_size=259)
    for param in medusa.parameters():
        torch.nn.init.normal_(param)
    state = medusa.state_dict()
    if file_name.endswith(".pt"):
        torch.save({key.removeprefix("medusa_head."): value for key, value in state.items()}, tmp_path / file_name)
    else:
        save_file({key: value.contiguous() for key, value in state.items()}, str(tmp_path / file_name))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    loaded = load_head(tmp_path, hidden_size=HIDDEN, dtype=torch.float32, device="cpu")
    assert isinstance(loaded, MedusaHeads) and loaded.own_lm_heads
    x = torch.randn(4, HIDDEN)
    torch.testing.assert_close(loaded(x), medusa(x))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_head(tmp_path, hidden_size=HIDDEN, dtype=torch.float32, device="cpu")
    save_head(_eagle(), tmp_path)
    with pytest.raises(ValueError, match="hidden size 64 is not the target's 128"):
        load_head(tmp_path, hidden_size=128, dtype=torch.float32, device="cpu")


def test_unreadable_folders_raise_value_errors_naming_the_file(tmp_path):
    """A truncated weights file, a config that is not JSON, and EAGLE weights beside a config without a Llama
    config's fields each raise ValueError naming the file (not a library's own exception)."""
    save_head(_eagle(), tmp_path)
    weights, config = tmp_path / "model.safetensors", tmp_path / "config.json"
    good_weights, good_config = weights.read_bytes(), config.read_text()
    weights.write_bytes(good_weights[:100])
    with pytest.raises(ValueError, match=r"model\.safetensors cannot be read"):
        load_head(tmp_path, hidden_size=HIDDEN, dtype=torch.float32, device="cpu")
    weights.write_bytes(good_weights)
    for text, message in (
        ("{not json", "is not JSON"),
        ("[1]", "is not a JSON object"),
        ('{"foo": 1}', "num_attention_heads"),
    ):
        config.write_text(text)
        with pytest.raises(ValueError, match=message) as raised:
            load_head(tmp_path, hidden_size=HIDDEN, dtype=torch.float32, device="cpu")
        assert "config.json" in str(raised.value)
    config.write_text(good_config)
    load_head(tmp_path, hidden_size=HIDDEN, dtype=torch.float32, device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_training_lowers_the_loss_and_resumes_from_its_checkpoint(tmp_path, method):
    model_dir = save_tiny_llama(tmp_path / "model")
    whole = train_tiny_heads(model_dir, method, 40, out_dir=tmp_path / "whole")
    assert sum(whole.losses[-5:]) < 0.8 * sum(whole.losses[:5])

    def interrupt(step, loss):
        if step == 33:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_tiny_heads(model_dir, method, 40, out_dir=tmp_path / "resumed", on_step=interrupt)
    # Run again, the run picks up at the checkpoint of step 30 and ends where the uninterrupted one did.
    rest = train_tiny_heads(model_dir, method, 40, out_dir=tmp_path / "resumed")
    assert (rest.first_step, len(rest.losses)) == (30, 10)
    assert rest.losses == pytest.approx(whole.losses[30:], rel=1e-4)
    assert torch.load(tmp_path / "resumed" / STATE_FILE, weights_only=False)["step"] == 40
    hidden = int(AutoConfig.from_pretrained(model_dir).hidden_size)
    a = load_head(tmp_path / "whole", hidden_size=hidden, dtype=torch.float32, device="cpu")
    b = load_head(tmp_path / "resumed", hidden_size=hidden, dtype=torch.float32, device="cpu")
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(pa, pb, msg=name)
