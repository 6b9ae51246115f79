"""Greedy identity of speculative decoding with learned heads on the real model (issue #31's acceptance).

The first ``--num-prompts`` (64) HumanEval prompts and chat questions (bench/workload.py's batch-one jobs,
``max_tokens`` 128, stopping at EOS), all lines of a job in one batch, decoded plainly and with EAGLE and Medusa
heads forced on (``speculative_mode="on"``) as chains (tree width 1) and trees (``--tree-width``, 4): every
line's token ids must equal plain decoding's. Heads come from ``--heads-dir`` (``<dir>/eagle``,
``<dir>/medusa``, as ``batchinfer heads train --out`` writes them; default beside the model).

Usage: python bench/spec_identity.py [--heads-dir DIR] [--num-prompts 64] [--tree-width 4] [--threads 1]
Prints one JSON line per job and configuration: ``lines``, ``tokens``, ``lines_differing``, the first ten
``first_divergence`` pairs (line, position), ``mean_accepted_len`` and ``cpu_s``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from workload import Workload, chat_batch_one, humaneval_batch_one  # noqa: E402

from worker.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from worker.model_prepare import prepare_model  # noqa: E402


def run(model: str, fields: dict[str, Any], workload: Workload) -> tuple[list[list[int]], float]:
    """Token ids of every line of ``workload`` in one batch, and the engine's mean accepted length."""
    engine = LLMEngine(EngineConfig(model=model, enable_prefix_caching=False, **fields))
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in workload.max_tokens]
    outputs = engine.generate(workload.prompt_token_ids, params)
    return [list(output.outputs[0].token_ids) for output in outputs], engine.make_stats().mean_accepted_length


def first_divergence(reference: list[int], ids: list[int]) -> int:
    """The first position where two id lists differ (the shorter one's length when one is a prefix)."""
    return next((p for p, (a, b) in enumerate(zip(reference, ids)) if a != b), min(len(reference), len(ids)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads-dir", type=Path)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--tree-width", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = str(prepare_model())
    heads_dir = args.heads_dir or Path(model) / "heads"
    tokenizer = AutoTokenizer.from_pretrained(model)
    jobs = {
        "humaneval": humaneval_batch_one(tokenizer, args.num_prompts),
        "chat": chat_batch_one(tokenizer, args.num_prompts),
    }
    configs = {
        f"{method}-w{width}": dict(
            speculative_mode="on",
            speculative_method=method,
            speculative_model=str(heads_dir / method),
            speculative_tree_width=width,
        )
        for method in ("eagle", "medusa")
        for width in (1, args.tree_width)
    }
    for job, workload in jobs.items():
        reference, _ = run(model, dict(speculative_mode="off"), workload)
        for name, fields in configs.items():
            start = time.process_time()
            ids, accepted = run(model, fields, workload)
            diverging = [(i, first_divergence(r, x)) for i, (r, x) in enumerate(zip(reference, ids)) if r != x]
            result = {
                "job": job,
                "config": name,
                "lines": len(reference),
                "tokens": sum(map(len, ids)),
                "lines_differing": len(diverging),
                "first_divergence": diverging[:10],
                "mean_accepted_len": round(accepted, 3),
                "cpu_s": round(time.process_time() - start, 1),
            }
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
