"""Held-out acceptance of trained draft heads: the mean accepted length ``tau`` without running the engine.

The held-out set is the first ``--num-prompts`` (16) prompts of ``examples/humaneval.jsonl`` and of
``examples/chat.jsonl`` (the prompts ``bench/spec.py`` times, which ``batchinfer heads train --skip-prompts 16``
never trains on). Their greedy completions (our engine, ``--max-tokens`` 128, all at once) and the target's
features over them are computed once and cached (``--cache`` and ``<cache>.features.pt``). Each head is then replayed along each completion
as greedy speculative decoding would run it at batch 1: with ``n`` tokens committed, the head drafts from the
features of positions ``<= n - 2`` (the last computed one), the longest prefix of the draft that equals the
completion is accepted plus the target's own token, and ``n`` advances by that many (capped at the completion's
end). ``tau`` is tokens per step (vLLM's mean accepted length); a completion counts from its second token (the
first comes from the prefill).

Drafts: EAGLE chains of depth ``k`` (the head's predicted feature fed back with the drafted token) and, with
``--tree-width`` ``w > 1``, EAGLE-2 trees of ``w`` per layer and ``k`` layers (the proposer's own tree code);
Medusa chains of its heads' top-1 tokens. The draft vocabulary stored with the head is used as the engine uses
it. Greedy output does not depend on drafts, so the accepted length here is the engine's, up to near-ties of
the target's argmax between a whole-sequence forward and decode steps.

Usage: python bench/head_replay.py HEAD_DIR [HEAD_DIR ...] [--num-prompts 16] [--max-tokens 128]
       [--depths 1,2,3,4] [--tree-width 2] [--cache FILE] [--threads 1]
Prints one JSON line per head: ``{"head", "method", "cpu_s", "tau": {"humaneval": {"chain1": ..}, "chat": ..}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from worker.cli_heads import DEFAULT_PROMPT_FILES, generate_sequences, prompt_texts  # noqa: E402
from worker.engine.executor.model_loader import load_model  # noqa: E402
from worker.engine.spec_decode.eagle_proposer import EagleProposer  # noqa: E402
from worker.engine.spec_decode.head_trees import DraftLMHead  # noqa: E402
from worker.engine.spec_decode.heads.eagle import EagleHead  # noqa: E402
from worker.engine.spec_decode.heads.storage import load_draft_vocab, load_head  # noqa: E402
from worker.engine.spec_decode.heads.train import target_features  # noqa: E402
from worker.model_prepare import prepare_model  # noqa: E402


def held_out(model_dir: Path, num_prompts: int, max_tokens: int, cache: Path) -> dict[str, list[tuple[int, list[int]]]]:
    """Per workload, ``(prompt length, prompt + greedy completion)`` of its first ``num_prompts`` prompts."""
    if cache.is_file():
        cached: dict[str, list[tuple[int, list[int]]]] = torch.load(cache)
        return cached
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = {
        name: prompt_texts([path], tokenizer, skip=0, limit=num_prompts)
        for name, path in zip(("humaneval", "chat"), DEFAULT_PROMPT_FILES, strict=True)
    }
    flat = [p for group in prompts.values() for p in group]
    sequences = iter(generate_sequences(model_dir, flat, max_tokens))
    result = {name: [(len(p), next(sequences)) for p in group] for name, group in prompts.items()}
    torch.save(result, cache)
    return result


def _steps(run_length: Any, prompt_len: int, length: int, depth: int) -> tuple[int, int]:
    """(tokens, steps) of greedy decoding from ``prompt_len + 1`` committed tokens to ``length``, accepting
    ``min(run_length(n), depth)`` drafts at ``n`` committed tokens, plus the target's token."""
    n, tokens, steps = prompt_len + 1, 0, 0
    while n < length:
        gained = min(run_length(n, depth) + 1, length - n)
        n, tokens, steps = n + gained, tokens + gained, steps + 1
    return tokens, steps


def eagle_taus(
    proposer: EagleProposer, embed: Any, seqs: list[tuple[int, list[int]]], data: Any, depths: list[int], width: int
) -> dict[str, float]:
    head = proposer.head
    assert isinstance(head, EagleHead)
    totals: dict[str, list[int]] = {}
    for (prompt_len, seq), f in zip(seqs, data.features, strict=True):
        x = torch.tensor(seq)
        num = len(seq) - 1
        pred, kv = head(f[:num], embed(x[1:]), torch.arange(num))
        run_length = _chain_run(proposer, embed, pred, kv, x)
        for depth in depths:
            tokens, steps = _steps(run_length, prompt_len, len(seq), depth)
            _add(totals, f"chain{depth}", tokens, steps)
        if width > 1:
            for depth in depths:
                tokens, steps = _steps(_tree_run(proposer, pred, kv, x), prompt_len, len(seq), depth)
                _add(totals, f"tree{width}x{depth}", tokens, steps)
    return {name: round(t / s, 3) for name, (t, s) in totals.items()}


def _chain_run(proposer: EagleProposer, embed: Any, pred: Any, kv: Any, x: Any) -> Any:
    """``run_length(n, depth)``: drafts of a ``depth`` chain accepted with ``n`` tokens committed (memoised)."""
    head = proposer.head
    first = proposer.lm.logits(pred).argmax(dim=-1)  # first[p]: the draft of token p + 2 from entry p
    memo: dict[int, tuple[int, int]] = {}  # n -> (drafts accepted, the depth drafted to)

    def run_length(n: int, depth: int) -> int:
        accepted, drafted = memo.get(n, (0, 0))
        if accepted < drafted or accepted >= depth:  # a mismatch was found, or deep enough
            return min(accepted, depth)
        accepted, feature = 0, pred[n - 2 : n - 1]
        past = (kv[0][:, : n - 1], kv[1][:, : n - 1])
        token = int(first[n - 2])
        while token == int(x[n + accepted]):
            accepted += 1
            if accepted >= depth or n + accepted >= len(x):
                break
            position = torch.tensor([n - 2 + accepted])
            feature, past = head(feature, embed(torch.tensor([token])), position, past)
            token = int(proposer.lm.logits(feature).argmax(dim=-1))
        memo[n] = (accepted, depth if n + accepted < len(x) else accepted + 1)
        return accepted

    return run_length


def _tree_run(proposer: EagleProposer, pred: Any, kv: Any, x: Any) -> Any:
    def run_length(n: int, depth: int) -> int:
        past = (kv[0][:, : n - 1], kv[1][:, : n - 1])
        tokens, parents = proposer._tree(SimpleNamespace(num_tokens=n), pred[n - 2 : n - 1], past, depth)
        matched_depth = [0] * len(tokens)
        best = 0
        for i, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
            at = 1 if parent < 0 else matched_depth[parent] + 1
            if (parent < 0 or matched_depth[parent] > 0) and n + at - 1 < len(x) and token == int(x[n + at - 1]):
                matched_depth[i] = at
                best = max(best, at)
        return best

    return run_length


def medusa_taus(
    heads: Any, lm: DraftLMHead, seqs: list[tuple[int, list[int]]], data: Any, depths: list[int]
) -> dict[str, float]:
    totals: dict[str, list[int]] = {}
    for (prompt_len, seq), f in zip(seqs, data.features, strict=True):
        x = torch.tensor(seq)
        out = heads(f)  # [K, L, hidden]: head k at position p drafts token p + 2 + k
        drafts = torch.stack([lm.logits(out[k]).argmax(dim=-1) for k in range(out.shape[0])])

        def run_length(n: int, depth: int, drafts: Any = drafts, x: Any = x) -> int:
            accepted = 0
            while accepted < min(depth, drafts.shape[0]) and n + accepted < len(x):
                if int(drafts[accepted, n - 2]) != int(x[n + accepted]):
                    break
                accepted += 1
            return accepted

        for depth in depths:
            tokens, steps = _steps(run_length, prompt_len, len(seq), depth)
            _add(totals, f"chain{depth}", tokens, steps)
    return {name: round(t / s, 3) for name, (t, s) in totals.items()}


def _add(totals: dict[str, list[int]], name: str, tokens: int, steps: int) -> None:
    entry = totals.setdefault(name, [0, 0])
    entry[0] += tokens
    entry[1] += steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", nargs="+", type=Path)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--depths", default="1,2,3,4")
    parser.add_argument("--tree-width", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/batchinfer-head-replay.pt"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    depths = [int(d) for d in args.depths.split(",")]
    model_dir = prepare_model(args.model)
    workloads = held_out(model_dir, args.num_prompts, args.max_tokens, args.cache)
    model = load_model(model_dir, torch.float32, "cpu")
    features_cache = args.cache.with_suffix(".features.pt")
    if features_cache.is_file():
        features = torch.load(features_cache, weights_only=False)
    else:
        features = {name: target_features(model, [seq for _, seq in seqs]) for name, seqs in workloads.items()}
        torch.save(features, features_cache)
    embed = model.model.embed_tokens
    hidden = int(model.config.hidden_size)
    with torch.inference_mode():
        for folder in args.heads:
            start = time.process_time()
            head = load_head(folder, hidden_size=hidden, dtype=torch.float32, device="cpu")
            vocab = load_draft_vocab(folder)
            taus = {}
            for name, seqs in workloads.items():
                if isinstance(head, EagleHead):
                    proposer = EagleProposer(head, model, None, vocab, tree_width=args.tree_width)
                    taus[name] = eagle_taus(proposer, embed, seqs, features[name], depths, args.tree_width)
                else:
                    taus[name] = medusa_taus(head, DraftLMHead(model, vocab), seqs, features[name], depths)
            method = "eagle" if isinstance(head, EagleHead) else "medusa"
            cpu_s = round(time.process_time() - start, 1)
            print(json.dumps({"head": str(folder), "method": method, "cpu_s": cpu_s, "tau": taus}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
