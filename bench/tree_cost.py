"""What a draft tree costs at batch 1: verification of ``n`` nodes and the heads' drafting, against a one-token step.

The target (SmolLM2-135M-Instruct, fp32, our engine's model and kernels, one thread) holds a context of ``--context``
tokens in a scratch paged cache; each timing is the median of ``--repeats`` calls by CPU time (other jobs on the
machine lengthen wall time, much less the CPU time of one thread):

- ``step_ms``: one decode step, the forward over 1 token and its logits (what plain decoding pays per token);
- ``verify_ms[n]``: the forward over the last token and a tree of ``n`` nodes (a chain for ``n = 1``; else a
  tree of width 2-4, ``--shape``) and logits at all ``1 + n`` rows, as the model runner verifies one;
- ``eagle_ms[w]``: one EAGLE drafting depth over ``w`` nodes: the head over ``w`` rows (past ``--context`` entries)
  and the LM head over them, full vocabulary and the draft vocabulary subset (``--draft-vocab``);
- ``medusa_ms``: all Medusa heads over one feature and their LM heads (full and subset).

Untrained heads of the trained shapes are timed (cost does not depend on the weights). From these the JSON line
gives each relative to ``step_ms``; docs/engine.md ("What a tree can buy here") combines them with the measured
acceptance into the best speed-up the heads can give on this machine.

Usage: python bench/tree_cost.py [--context 256] [--repeats 20] [--max-nodes 16] [--shape 2] [--draft-vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _median_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` by the process's CPU time (one thread: stable under a loaded machine)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1000.0 * statistics.median(times)


def tree_of(num_nodes: int, width: int) -> list[int]:
    """A tree of ``num_nodes`` nodes, breadth first with ``width`` children per expanded node (a chain for width 1)."""
    parents: list[int] = []
    frontier = [-1]
    while len(parents) < num_nodes:
        nxt = []
        for parent in frontier:
            for _ in range(width):
                if len(parents) < num_nodes:
                    parents.append(parent)
                    nxt.append(len(parents) - 1)
        # Only the first child of each expanded node grows further (EAGLE-2's top nodes lie on few paths).
        frontier = nxt[:: max(1, width)] if width > 1 else nxt
    return parents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-nodes", type=int, default=16)
    parser.add_argument("--shape", type=int, default=2, help="children per expanded node of the timed trees")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    args = parser.parse_args()

    import torch

    from worker.engine.executor.layers.attention import build_attention_metadata, cpu_kernels_apply
    from worker.engine.executor.model_loader import load_model
    from worker.engine.executor.models.llama import head_size_of, num_kv_heads_of
    from worker.engine.spec_decode.heads.eagle import EagleHead, EagleHeadConfig
    from worker.engine.spec_decode.heads.medusa import MedusaHeads
    from worker.model_prepare import prepare_model

    torch.set_num_threads(1)
    model = load_model(prepare_model(), torch.float32, "cpu")
    config = model.config
    block_size = 16
    num_kv_heads = num_kv_heads_of(config)
    capacity = args.context + args.max_nodes + 1
    num_blocks = math.ceil(capacity / block_size)
    kv_caches = [
        torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size_of(config))
        for _ in range(int(config.num_hidden_layers))
    ]
    table = [list(range(num_blocks))]
    qpk = int(config.num_attention_heads) // num_kv_heads
    kernels = cpu_kernels_apply(torch.device("cpu"), torch.float32)

    def forward(tokens: int, parents: list[int] | None) -> None:
        metadata = build_attention_metadata(
            [tokens],
            [args.context + tokens],
            table,
            block_size,
            num_queries_per_kv=qpk,
            use_cpu_kernels=kernels,
            tree_parents=[parents] if parents is not None else None,
        )
        ids = torch.randint(0, int(config.vocab_size), (tokens,))
        hidden = model(ids, metadata.positions, kv_caches, metadata)
        model.compute_logits(hidden)

    with torch.inference_mode():
        # Fill the context once (its K/V values do not change the cost).
        metadata = build_attention_metadata(
            [args.context], [args.context], table, block_size, num_queries_per_kv=qpk, use_cpu_kernels=kernels
        )
        model(torch.randint(0, 1000, (args.context,)), metadata.positions, kv_caches, metadata)
        step_ms = _median_ms(lambda: forward(1, None), args.repeats)
        verify_ms = {}
        for n in range(1, args.max_nodes + 1):
            parents = tree_of(n, 1 if n == 1 else args.shape)
            is_chain = all(p == i - 1 for i, p in enumerate(parents))
            verify_ms[n] = _median_ms(lambda p=parents, c=is_chain: forward(1 + len(p), None if c else p), args.repeats)

        hidden_size, vocab = int(config.hidden_size), int(config.vocab_size)
        eagle = EagleHead(EagleHeadConfig.for_target(config)).eval()
        medusa = MedusaHeads(hidden_size, 3).eval()
        lm_head = model.model.embed_tokens.weight  # tied: the LM head's weights
        subset = lm_head[: args.draft_vocab].contiguous()
        pos = torch.arange(args.context)
        _, past = eagle(torch.randn(args.context, hidden_size), torch.randn(args.context, hidden_size), pos)
        eagle_ms: dict[int, dict[str, float]] = {}
        for w in (1, 2, 4, 8):
            feats, embeds = torch.randn(w, hidden_size), torch.randn(w, hidden_size)
            where = torch.full((w,), args.context)
            head_ms = _median_ms(lambda f=feats, e=embeds, p=where: eagle(f, e, p, past), args.repeats)
            full_ms = _median_ms(lambda f=feats: model.compute_logits(f), args.repeats)
            sub_ms = _median_ms(lambda f=feats: f @ subset.T, args.repeats)
            eagle_ms[w] = {"head_ms": head_ms, "lm_head_ms": full_ms, "lm_head_subset_ms": sub_ms}
        feature = torch.randn(1, hidden_size)
        medusa_heads_ms = _median_ms(lambda: medusa(feature), args.repeats)
        rows = torch.randn(3, hidden_size)
        medusa_lm_ms = _median_ms(lambda: model.compute_logits(rows), args.repeats)
        medusa_sub_ms = _median_ms(lambda: rows @ subset.T, args.repeats)

    print(
        json.dumps(
            {
                "context": args.context,
                "threads": 1,
                "tree_width": args.shape,
                "draft_vocab": args.draft_vocab,
                "vocab_size": vocab,
                "step_ms": step_ms,
                "verify_ms": verify_ms,
                "verify_rel": {n: ms / step_ms for n, ms in verify_ms.items()},
                "eagle_ms": eagle_ms,
                "eagle_depth_rel": {
                    w: {
                        "full": (v["head_ms"] + v["lm_head_ms"]) / step_ms,
                        "subset": (v["head_ms"] + v["lm_head_subset_ms"]) / step_ms,
                    }
                    for w, v in eagle_ms.items()
                },
                "medusa_ms": {
                    "heads_ms": medusa_heads_ms,
                    "lm_head_ms": medusa_lm_ms,
                    "lm_head_subset_ms": medusa_sub_ms,
                },
                "medusa_rel": {
                    "full": (medusa_heads_ms + medusa_lm_ms) / step_ms,
                    "subset": (medusa_heads_ms + medusa_sub_ms) / step_ms,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
