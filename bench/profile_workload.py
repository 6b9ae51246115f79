"""Where the time goes on the throughput workload, against what this CPU's arithmetic allows (issue 15's ruler).

Runs the mixed workload of ``bench/throughput.py`` (``bench/workload.py``, ``humaneval_throughput``: the first
``--num-prompts`` HumanEval prompts, ``max_tokens`` uniform in 16..160, greedy, ``ignore_eos``, prefix caching
off) on one engine: one short warm-up, one clean timed run (``tok_per_s``), then one run with profiling on.

**Profiling** is installed by this script from the outside and removed afterwards; the engine has no timing
code of its own for it. Forward pre/post hooks time every module call (``time.perf_counter``; the CPU runs
synchronously): the five projections (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` and
``lm_head``, ``PackedLinear`` or ``nn.Linear``), the RMSNorms, the rotary embedding, the embedding, and the
attention block, MLP and decoder layer that contain them. The model module's ``paged_attention_forward`` is
swapped for a timed wrapper, the runner's sampler for a timed callable, and ``execute_model`` for one that
notes the step's shape. Exclusive times follow by subtraction: activation = MLP - gate_up - down;
residual = layer - its two norms - attention block - MLP; attention glue (reshapes and splits) = attention
block - qkv - o - RoPE - q/k norms - attention; scheduling/Python = step wall time - every part above - sampling.

**Step kinds**: ``prefill`` when at least half the step's tokens are prompt tokens (not a sequence's one
decode token); otherwise ``decode_large`` with 32 or more sequences in the step, else ``decode_small``.
An attention call counts as ``cascade`` when its plan uses cascade attention, ``decode`` when every sequence
adds one token, else ``prefill`` (prefill/extend; mixed steps included).

**Arithmetic limit** (``bench/arithmetic.py``: the FLOP formulas and the calibration): the workload's FLOPs
are counted from the workload itself, not from what the engine ran; the peak is a ``--calibration-size``
square float32 product in this process, best of ``--calibration-reps``, through our packed kernel and through
``torch.matmul``, the larger of the two. ``limit_tok_per_s = output_tokens / (workload_flops / peak)``;
``fraction_of_limit`` = clean ``tok_per_s / limit_tok_per_s``.

Usage: python bench/profile_workload.py [--num-prompts 64] [--threads 2] [--calibration-size 2048] [--calibration-reps 3]
Prints a table per step kind, then a last line with one JSON object (``peak_gflops``, ``limit_tok_per_s``,
``fraction_of_limit``, ``parts_s`` and per kind its parts, steps and GFLOP/s). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from arithmetic import attention_flops, calibrate_peak, model_dims, workload_flops  # noqa: E402
from workload import Workload, humaneval_throughput  # noqa: E402

from worker.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from worker.engine.executor.models import llama as llama_module  # noqa: E402
from worker.model_prepare import prepare_model  # noqa: E402

PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")
ATTENTION_KINDS = ("prefill", "decode", "cascade")
ELEMENTWISE = ("norm", "rope", "activation", "residual", "attn_glue", "embedding")
STEP_KINDS = ("prefill", "decode_large", "decode_small")
LARGE_DECODE_SEQS = 32
PARTS = (
    *(f"gemm_{p}" for p in PROJECTIONS),
    *(f"attention_{k}" for k in ATTENTION_KINDS),
    *ELEMENTWISE,
    "sampling",
    "python",
)


class StepProfiler:
    """Module-call and attention times of the current step, folded per step kind by :meth:`end_step`."""

    def __init__(self, dims: dict[str, int]) -> None:
        self.dims = dims
        self.starts: dict[int, list[float]] = defaultdict(list)
        self.step: dict[str, float] = defaultdict(float)
        self.step_flops: dict[str, float] = defaultdict(float)
        self.step_shape: tuple[int, int, int] | None = None  # tokens, prompt tokens, sequences
        self.seconds: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind in STEP_KINDS}
        self.flops: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind in STEP_KINDS}
        self.steps: dict[str, int] = dict.fromkeys(STEP_KINDS, 0)

    def timed_module(self, module: nn.Module, label: str, gemm: bool = False) -> list[Any]:
        """Time ``module``'s calls into ``label``; a GEMM also counts ``2*M*K*N``. Returns the hook handles."""

        def pre(mod: nn.Module, args: tuple[Any, ...]) -> None:
            self.starts[id(mod)].append(time.perf_counter())

        def post(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            self.step[label] += time.perf_counter() - self.starts[id(mod)].pop()
            if gemm:
                x = args[0]
                self.step_flops[label] += 2.0 * x.numel() * out.shape[-1]

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def timed_attention(self, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapper(query, key, value, kv_cache, attn_metadata, *args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            out = forward(query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            plan = attn_metadata.plan
            if plan.cascade is not None:
                kind = "cascade"
            elif attn_metadata.num_tokens == attn_metadata.num_seqs:
                kind = "decode"
            else:
                kind = "prefill"
            self.step[f"attention_{kind}"] += time.perf_counter() - start
            self.step_flops[f"attention_{kind}"] += attention_flops(
                self.dims, attn_metadata.query_lens_list, attn_metadata.seq_lens_list
            )
            return out

        return wrapper

    def timed_call(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.step[label] += time.perf_counter() - start
            return out

        return wrapper

    def note_shape(self, execute_model: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(scheduler_output: Any, *args: Any) -> Any:
            decode = sum(
                1
                for seq, n in zip(scheduler_output.seqs, scheduler_output.num_scheduled_tokens)
                if n == 1 and seq.output_token_ids and seq.num_computed_tokens == seq.num_tokens - 1
            )
            total = scheduler_output.total_num_scheduled_tokens
            self.step_shape = (total, total - decode, len(scheduler_output.seqs))
            return execute_model(scheduler_output, *args)

        return wrapper

    def end_step(self, wall_s: float) -> None:
        """Fold the step's raw times into exclusive parts under its kind; reset for the next step."""
        raw, flops, shape = self.step, self.step_flops, self.step_shape
        self.step, self.step_flops, self.step_shape = defaultdict(float), defaultdict(float), None
        if shape is None:  # nothing was scheduled
            return
        tokens, prompt_tokens, seqs = shape
        kind = "decode_large" if seqs >= LARGE_DECODE_SEQS else "decode_small"
        if 2 * prompt_tokens >= tokens:
            kind = "prefill"
        attention = sum(raw[f"attention_{k}"] for k in ATTENTION_KINDS)
        parts = {f"gemm_{p}": raw[p] for p in PROJECTIONS}
        parts.update({f"attention_{k}": raw[f"attention_{k}"] for k in ATTENTION_KINDS})
        parts["norm"] = raw["norm"] + raw["qk_norm"] + raw["layer_norm"]
        parts["rope"] = raw["rope"]
        parts["embedding"] = raw["embedding"]
        parts["activation"] = raw["mlp"] - raw["gate_up"] - raw["down"]
        parts["attn_glue"] = raw["attn_block"] - raw["qkv"] - raw["o"] - raw["rope"] - raw["qk_norm"] - attention
        parts["residual"] = raw["layer"] - raw["layer_norm"] - raw["attn_block"] - raw["mlp"]
        parts["sampling"] = raw["sampling"]
        parts["python"] = wall_s - sum(parts.values())
        for name, value in parts.items():
            self.seconds[kind][name] += value
        self.seconds[kind]["step"] += wall_s
        for name, value in flops.items():
            self.flops[kind][name] += value
        self.steps[kind] += 1


def label_of(name: str, module: nn.Module) -> str | None:
    """The profiler label of a named module of the model, or None for modules not timed on their own."""
    last = name.rsplit(".", 1)[-1]
    if last in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        return last.removesuffix("_proj")
    if last == "lm_head":
        return "lm_head"
    if last in ("q_norm", "k_norm"):
        return "qk_norm"
    if last in ("input_layernorm", "post_attention_layernorm"):
        return "layer_norm"
    if name == "model.norm":
        return "norm"
    if last == "embed_tokens":
        return "embedding"
    if last == "self_attn":
        return "attn_block"
    if last == "mlp":
        return "mlp"
    if isinstance(module, llama_module.LlamaDecoderLayer):
        return "layer"
    return None


@contextmanager
def profiling(engine: LLMEngine, profiler: StepProfiler) -> Iterator[None]:
    """Install the hooks and wrappers on ``engine`` (module docstring); remove them on exit."""
    runner = engine.model_runner
    model = runner.model
    # NOTE: a fused decoder layer (llama.FusedCpuLayer) runs its projections, norms and RoPE in C++, where the
    # module hooks below cannot see them: the profiled run takes the module path (the clean run does not).
    fused_layers = [(m, m.fused_cpu) for m in model.modules() if isinstance(m, llama_module.LlamaDecoderLayer)]
    for layer, _ in fused_layers:
        layer.fused_cpu = None
    handles = []
    for name, module in model.named_modules():
        label = label_of(name, module)
        if label is not None:
            handles += profiler.timed_module(module, label, gemm=label in PROJECTIONS)
    rotary = {id(m): m for m in model.modules() if isinstance(m, llama_module.RotaryEmbedding)}
    for module in rotary.values():
        handles += profiler.timed_module(module, "rope")
    original_attention = llama_module.paged_attention_forward
    llama_module.paged_attention_forward = profiler.timed_attention(original_attention)
    original_sampler = runner.sampler
    runner.sampler = profiler.timed_call("sampling", original_sampler)  # type: ignore[assignment]
    runner.execute_model = profiler.note_shape(runner.execute_model)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del runner.execute_model  # back to the class's method
        runner.sampler = original_sampler
        llama_module.paged_attention_forward = original_attention
        for handle in handles:
            handle.remove()
        for layer, fused in fused_layers:
            layer.fused_cpu = fused


def run_workload(engine: LLMEngine, workload: Workload, after_step: Callable[[float], None] | None = None) -> float:
    """Run the workload through ``add_request`` / ``step``; returns wall seconds. ``after_step(step wall s)``."""
    for i, (ids, max_tokens) in enumerate(zip(workload.prompt_token_ids, workload.max_tokens)):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        engine.step()
        if after_step is not None:
            after_step(time.perf_counter() - step_start)
    return time.perf_counter() - start


def gflops(flops: float, seconds: float) -> float | None:
    return flops / seconds / 1e9 if seconds > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--calibration-size", type=int, default=2048)
    parser.add_argument("--calibration-reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = prepare_model()
    from transformers import AutoTokenizer

    workload = humaneval_throughput(AutoTokenizer.from_pretrained(model_dir), args.num_prompts)
    engine = LLMEngine(EngineConfig(model=str(model_dir), enable_prefix_caching=False))
    dims = model_dims(engine.model_config)
    engine.generate([workload.prompt_token_ids[0]], SamplingParams(max_tokens=4, temperature=0.0))
    clean_s = run_workload(engine, workload)
    profiler = StepProfiler(dims)
    with profiling(engine, profiler):
        profiled_s = run_workload(engine, workload, profiler.end_step)
    calibration = calibrate_peak(args.calibration_size, args.calibration_reps)

    peak = calibration["peak_gflops"] * 1e9
    flops = workload_flops(dims, workload)
    total_flops = sum(flops.values())
    output_tokens = workload.num_output_tokens
    limit_tok_per_s = output_tokens / (total_flops / peak)
    tok_per_s = output_tokens / clean_s

    kinds: dict[str, Any] = {}
    for kind in STEP_KINDS:
        seconds, kind_flops = profiler.seconds[kind], profiler.flops[kind]
        attention_s = sum(seconds[f"attention_{k}"] for k in ATTENTION_KINDS)
        attention_flops_ = sum(kind_flops[f"attention_{k}"] for k in ATTENTION_KINDS)
        kinds[kind] = {
            "steps": profiler.steps[kind],
            "step_s": seconds["step"],
            "parts_s": {part: seconds[part] for part in PARTS},
            "gflops": {
                **{p: gflops(kind_flops[p], seconds[f"gemm_{p}"]) for p in PROJECTIONS},
                "attention": gflops(attention_flops_, attention_s),
            },
        }
    parts_s = {part: sum(profiler.seconds[kind][part] for kind in STEP_KINDS) for part in PARTS}
    measured = {name: sum(profiler.flops[kind][name] for kind in STEP_KINDS) for name in PROJECTIONS}
    measured["attention"] = sum(profiler.flops[kind][f"attention_{k}"] for kind in STEP_KINDS for k in ATTENTION_KINDS)
    attention_s = sum(parts_s[f"attention_{k}"] for k in ATTENTION_KINDS)
    overall_gflops = {p: gflops(measured[p], parts_s[f"gemm_{p}"]) for p in PROJECTIONS}
    overall_gflops["attention"] = gflops(measured["attention"], attention_s)

    for kind, entry in kinds.items():
        print(f"== {kind}: {entry['steps']} steps, {entry['step_s']:.3f} s")
        for part, value in entry["parts_s"].items():
            share = value / entry["step_s"] if entry["step_s"] else 0.0
            print(f"   {part:<20} {value:8.3f} s  {share:6.1%}")
        rates = ", ".join(f"{k} {v:.1f}" for k, v in entry["gflops"].items() if v is not None)
        print(f"   GFLOP/s: {rates}")
    print(
        f"peak {calibration['peak_gflops']:.1f} GFLOP/s; workload {total_flops / 1e9:.1f} GFLOP -> limit "
        f"{limit_tok_per_s:.1f} tok/s; achieved {tok_per_s:.1f} tok/s = {tok_per_s / limit_tok_per_s:.1%} of it"
    )
    print(
        json.dumps(
            {
                "workload": workload.name,
                "prompt_tokens": workload.num_prompt_tokens,
                "output_tokens": output_tokens,
                "threads": args.threads,
                **calibration,
                "workload_gflop": {name: value / 1e9 for name, value in flops.items()},
                "measured_gflop": {name: value / 1e9 for name, value in measured.items()},
                "limit_tok_per_s": limit_tok_per_s,
                "tok_per_s": tok_per_s,
                "profiled_tok_per_s": output_tokens / profiled_s,
                "fraction_of_limit": tok_per_s / limit_tok_per_s,
                "parts_s": parts_s,
                "step_s": sum(profiler.seconds[kind]["step"] for kind in STEP_KINDS),
                "gflops": overall_gflops,
                "kinds": kinds,
            }
        )
    )


if __name__ == "__main__":
    main()
