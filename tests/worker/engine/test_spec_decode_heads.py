"""Speculative decoding with learned heads (EAGLE, Medusa) end to end on a tiny random Llama.

Greedy lines give the plain completions (ids, text, finish and stop reasons, logprobs) alone, batched, with
stops and max_tokens landing inside accepted drafts, beside sampled lines and under preemption; sampled lines
keep the target distribution (chi-square); a method without heads fails at start naming the training command.
The heads are trained briefly on the tiny model's own outputs (acceptance well above zero).
"""

import pytest
import torch

from tests.helpers.tiny_heads import save_random_heads, train_tiny_heads
from tests.helpers.tiny_llama import save_tiny_llama
from tests.worker.engine.spec_decode.stats_helpers import chi_square_p_value
from tests.worker.engine.test_spec_decode import (
    CYCLE,
    KS,
    PROMPTS,
    REPEAT,
    VARIED,
    _dropped_in_run,
    assert_alone_and_batched_match_plain,
    assert_same_completion,
    make_engine,
    run_checked,
)
from worker.engine import SamplingParams
from worker.engine.spec_decode.heads.train import target_features

METHODS = ["eagle", "medusa"]


@pytest.fixture(scope="module")
def heads_model_dir(tmp_path_factory):
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("tiny_heads"))
    for method in METHODS:
        train_tiny_heads(model_dir, method, 60)
    return model_dir


@pytest.fixture(scope="module")
def plain_engine(heads_model_dir):
    return make_engine(heads_model_dir, mode="off")


def _engine(model_dir, method, **overrides):
    return make_engine(model_dir, speculative_method=method, num_speculative_tokens=4, **overrides)


@pytest.mark.parametrize("tree_width", [1, 3])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_alone_and_batched(heads_model_dir, plain_engine, method, tree_width):
    """Chains, and with ``tree_width`` 3 EAGLE-2's dynamic tree and Medusa's product tree (more nodes than depth)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    engine = _engine(heads_model_dir, method, speculative_tree_width=tree_width)
    assert_alone_and_batched_match_plain(engine, plain_engine, PROMPTS, params)
    stats = engine.make_stats()
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.mean_accepted_length > 1.2
    if tree_width > 1:
        assert stats.num_draft_tokens >= 3 * stats.num_drafts, "drafts were not trees of width 3"


@pytest.mark.parametrize("method", METHODS)
def test_heads_see_the_features_of_accepted_tree_paths(heads_model_dir, method):
    """After a tree's verification the features handed to the heads are those of the accepted path's positions
    (node rows moved like their K/V), equal to one prefill over the finished sequence, also when the path left
    the tree's leading chain."""
    engine = _engine(heads_model_dir, method, speculative_tree_width=3)
    runner = engine.model_runner
    features: dict[int, torch.Tensor] = {}  # position -> the latest row written there
    sink = runner.hidden_states_sink

    def record(seqs, num_computed, num_scheduled, hidden_states):
        features.update({num_computed[0] + row: hidden_states[row].clone() for row in range(num_scheduled[0])})
        sink(seqs, num_computed, num_scheduled, hidden_states)

    runner.hidden_states_sink = record
    moved_paths = 0
    execute = runner.execute_model

    def count_moves(*args, **kwargs):
        nonlocal moved_paths
        output = execute(*args, **kwargs)
        moved_paths += sum(r.accepted_nodes != list(range(len(r.accepted_nodes))) for r in output.verified)
        return output

    runner.execute_model = count_moves
    prompt = VARIED
    out = run_checked(engine, [prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0]
    tokens = prompt + list(out.outputs[0].token_ids)
    reference = target_features(runner.model, [tokens]).features[0]
    assert moved_paths > 0, "no accepted path left the leading chain"
    recorded = torch.stack([features[p] for p in range(len(tokens) - 1)])
    torch.testing.assert_close(recorded, reference[:-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree_width", [1, 3])
@pytest.mark.parametrize("method", METHODS)
def test_stops_and_max_tokens_inside_accepted_drafts(heads_model_dir, plain_engine, method, tree_width):
    engine = _engine(heads_model_dir, method, speculative_tree_width=tree_width)
    base = dict(temperature=0, max_tokens=40, logprobs=1, ignore_eos=True)
    ids = plain_engine.generate([REPEAT], SamplingParams(**base))[0].outputs[0].token_ids
    cases = [(REPEAT, dict(stop_token_ids=[ids[j]], min_tokens=j)) for j in (5, 9, 14)]
    cases += [(KS, dict(stop=["kkk"], min_tokens=j)) for j in (5, 9)]
    cases += [(KS, dict(stop=["kk"], min_tokens=7, include_stop_str_in_output=True))]
    cases += [(REPEAT, dict(max_tokens=m)) for m in (5, 11, 23)]
    dropped = 0
    for prompt, case in cases:
        params = SamplingParams(**{**base, **case})
        expected = plain_engine.generate([prompt], params)[0]
        engine.make_stats()
        assert_same_completion(expected, run_checked(engine, [prompt], params)[0])
        dropped += _dropped_in_run(engine)
    assert dropped > 0, "no case finished inside an accepted run"


@pytest.mark.parametrize("method", METHODS)
def test_greedy_unchanged_beside_sampled_lines_and_under_preemption(heads_model_dir, plain_engine, method):
    """Greedy lines verify trees (``tree_width`` 3) beside sampled lines' drawn chains."""
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.9, max_tokens=48, ignore_eos=True, seed=s) for s in range(3)]
    prompts = PROMPTS + [VARIED[5:], CYCLE[2:], REPEAT[:20]]
    expected = [plain_engine.generate([prompt], greedy)[0] for prompt in PROMPTS]
    # 14 blocks of 8 tokens cannot hold every line: the youngest are preempted and recomputed.
    engine = _engine(heads_model_dir, method, num_gpu_blocks_override=14, max_model_len=96, speculative_tree_width=3)
    outputs = run_checked(engine, prompts, [greedy] * 3 + sampled)
    for ref, out in zip(expected, outputs[:3]):
        assert_same_completion(ref, out)
    stats = engine.make_stats()
    assert stats.num_preemptions > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens


def test_a_method_without_heads_names_the_training_command(tmp_path):
    model_dir = save_tiny_llama(tmp_path / "bare")
    with pytest.raises(ValueError, match="batchinfer heads train --method eagle"):
        _engine(model_dir, "eagle")


def test_broken_heads_fail_their_method_and_are_left_out_under_auto(tmp_path):
    """A heads folder that cannot serve the target (weights missing, a truncated file, a draft vocabulary or
    Medusa LM heads of another vocabulary) fails ``speculative_method`` eagle / medusa at start naming the folder,
    and under ``auto`` is left out: the engine runs on n-gram lookup and greedy output stays plain decoding's."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoConfig

    from worker.engine.spec_decode.heads.medusa import MedusaHeads
    from worker.engine.spec_decode.heads.storage import DRAFT_VOCAB_FILE, save_head

    model_dir = save_tiny_llama(tmp_path / "model")
    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    hidden = int(AutoConfig.from_pretrained(model_dir).hidden_size)
    save_random_heads(model_dir)
    eagle, medusa = model_dir / "heads" / "eagle", model_dir / "heads" / "medusa"
    (eagle / "model.safetensors").unlink()
    shutil.rmtree(medusa)
    save_head(MedusaHeads(hidden, 2, 1, vocab_size=vocab + 50), medusa)
    with pytest.raises(ValueError, match="eagle holds no head weights"):
        _engine(model_dir, "eagle")
    with pytest.raises(ValueError, match=f"own LM heads have {vocab + 50} rows, the target's vocabulary {vocab}"):
        _engine(model_dir, "medusa")
    shutil.rmtree(medusa)
    save_random_heads(model_dir)
    save_file({"token_ids": torch.arange(vocab - 4, vocab + 60)}, str(medusa / DRAFT_VOCAB_FILE))
    (eagle / "model.safetensors").write_bytes((medusa / "model.safetensors").read_bytes()[:100])
    with pytest.raises(ValueError, match="token ids outside the target's vocabulary"):
        _engine(model_dir, "medusa")
    with pytest.raises(ValueError, match=r"model\.safetensors cannot be read"):
        _engine(model_dir, "eagle")
    engine = _engine(model_dir, "auto")
    assert engine.speculator is not None and engine.speculator.alternatives == []
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_engine(model_dir, mode="off")
    for prompt in PROMPTS[:2]:
        assert_same_completion(engine.generate([prompt], params)[0], plain.generate([prompt], params)[0])


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_sampling_preserves_the_target_distribution(tmp_path_factory, method):
    """Seeded lines of 3 tokens on a 12-token vocabulary: the joint distribution with the head's drafts (drawn
    from its ``q``) cannot be told apart from plain sampling's (chi-square, p > 1e-3)."""
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("tiny_vocab12"), seed=1, vocab_size=12)
    save_random_heads(model_dir)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 6, 7, 3, 4]
    torch.manual_seed(0)
    num_lines = 2000
    samples = {}
    for mode in ("on", "off"):
        engine = _engine(model_dir, method, mode=mode, speculative_disable_by_batch_size=num_lines)
        params = [
            SamplingParams(temperature=1.0, repetition_penalty=1.2, max_tokens=3, ignore_eos=True, seed=seed)
            for seed in range(num_lines)
        ]
        outputs = engine.generate([prompt] * num_lines, params)
        samples[mode] = [tuple(out.outputs[0].token_ids) for out in outputs]
        if mode == "on":
            stats = engine.make_stats()
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert chi_square_p_value(samples["on"], samples["off"]) > 1e-3
    assert chi_square_p_value([s[1:] for s in samples["on"]], [s[1:] for s in samples["off"]]) > 1e-3


def test_auto_method_chooses_among_ngram_and_the_heads_beside_the_model(heads_model_dir, plain_engine):
    """``speculative_method="auto"`` finds both heads; whichever drafts, greedy lines stay plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    engine = _engine(heads_model_dir, "auto", speculative_tree_width=2)
    assert engine.speculator is not None and len(engine.speculator.alternatives) == 2
    assert_alone_and_batched_match_plain(engine, plain_engine, PROMPTS, params)
    assert engine.make_stats().num_accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_head_replay_counts_what_the_engine_accepts(heads_model_dir, method):
    """bench/head_replay.py's held-out replay of 1-deep chains accepts what the engine accepts on the same lines."""
    from bench.head_replay import eagle_taus, medusa_taus
    from worker.engine.executor.model_loader import load_model
    from worker.engine.spec_decode.eagle_proposer import EagleProposer
    from worker.engine.spec_decode.head_trees import DraftLMHead
    from worker.engine.spec_decode.heads.storage import default_heads_dir, load_draft_vocab, load_head

    prompts = [VARIED, CYCLE, KS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    taus = []
    for prompt in prompts:  # batch 1, one draft per step
        engine = make_engine(heads_model_dir, speculative_method=method, num_speculative_tokens=1)
        completion = list(engine.generate([list(prompt)], params)[0].outputs[0].token_ids)
        stats = engine.make_stats()
        taus.append((len(prompt), prompt + completion, stats.num_drafts, stats.num_accepted_tokens))
    model = load_model(heads_model_dir, torch.float32, "cpu")
    folder = default_heads_dir(heads_model_dir, method)
    head = load_head(folder, hidden_size=int(model.config.hidden_size), dtype=torch.float32, device="cpu")
    vocab = load_draft_vocab(folder)
    for prompt_len, seq, num_drafts, num_accepted in taus:
        data = target_features(model, [seq])
        with torch.inference_mode():
            if method == "eagle":
                proposer = EagleProposer(head, model, None, vocab)
                tau = eagle_taus(proposer, model.model.embed_tokens, [(prompt_len, seq)], data, [1], 1)["chain1"]
            else:
                tau = medusa_taus(head, DraftLMHead(model, vocab), [(prompt_len, seq)], data, [1])["chain1"]
        generated = len(seq) - prompt_len - 1  # after the prefill's token
        # The replay's steps: generated tokens / tau; the engine drafts at every step but (maybe) the last.
        replay_accepted = generated - round(generated / tau)
        assert abs(replay_accepted - num_accepted) <= 1, (tau, num_drafts, num_accepted)
