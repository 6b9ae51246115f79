"""CPU time of one batch-1 q4 decode step and of its parts (issue #27), for a shared machine.

Wall-clock figures are meaningless where other processes take the cores, so everything here is CPU time
(``time.thread_time`` of the calling thread, ``time.process_time`` of every thread), best of ``--repeats``
runs of ``--steps`` steps or calls, in one process. The engine is bench/quant.py's (``quantization``, the
built-in GGUF, prefix caching off); one sequence (a 32-token prompt) is prefilled and decoded for 8 warm-up
steps first. Parts:

- ``step``: ``LLMEngine.step()`` (scheduler, runner, the model, the LM head, the sampler, outputs).
- ``step_module_path``: the same with the fused decoder layers off (``LlamaDecoderLayer.fused_cpu``: each layer
  through its modules, as before the fused layers); the parts below are measured on this path, whose
  ``GGUFLinear`` calls can be captured.
- ``step_without_linears``: the same with every ``GGUFLinear`` returning the output it computed at one
  captured step (no kernel runs): attention, norms, RoPE, SwiGLU, sampler, Python and scheduling.
- ``linears``: the step's 121 ``GGUFLinear`` calls alone (30 layers x qkv/o/gate_up/down, plus the LM head)
  on the inputs captured at that step, back to back: their weights come from memory (or the L3) as in a step.
- ``per_call_us``: each distinct layer shape called repeatedly on its own (its weight stays in the caches):
  the kernel's cost without the memory's.

With 2 threads ``thread`` is the calling thread's share (the parallel work it did, the serial parts, not the
time it slept waiting for the other thread) and ``process`` both threads' sum.

Usage: python bench/q4_step_cpu.py [--threads 1] [--quantization q4] [--steps 16] [--repeats 7]
Prints one JSON line (milliseconds unless named ``_us``). docs/engine.md, "Quantized weights".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.cpu_threads import use_bounded_wait


def cpu_ms(fn: Callable[[], Any], calls: int, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` CPU milliseconds per call of ``fn`` (``calls`` calls a run), thread and process."""
    thread, process = [], []
    for _ in range(repeats):
        thread_start, process_start = time.thread_time(), time.process_time()
        for _ in range(calls):
            fn()
        thread.append((time.thread_time() - thread_start) / calls * 1e3)
        process.append((time.process_time() - process_start) / calls * 1e3)
    return {"thread": round(min(thread), 4), "process": round(min(process), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quantization", default="q4")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    use_bounded_wait()
    from quant import _engine

    from worker.engine import SamplingParams
    from worker.engine.executor.layers.quantization.q4 import GGUFLinear
    from worker.engine.executor.models.llama import LlamaDecoderLayer

    engine = _engine(args.quantization, args.threads)
    engine.add_request(
        "b1", list(range(100, 132)), SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    )
    for _ in range(8):
        engine.step()
    result: dict[str, Any] = {"threads": args.threads, "quantization": args.quantization}
    result["step"] = cpu_ms(engine.step, args.steps, args.repeats)
    for module in engine.model_runner.model.modules():
        if isinstance(module, LlamaDecoderLayer):
            module.fused_cpu = None
    result["step_module_path"] = cpu_ms(engine.step, args.steps, args.repeats)

    inputs: dict[GGUFLinear, Any] = {}
    outputs: dict[GGUFLinear, Any] = {}
    forward = GGUFLinear.forward

    def capture(self: GGUFLinear, x: Any) -> Any:
        inputs[self] = x.clone()
        outputs[self] = forward(self, x)
        return outputs[self]

    GGUFLinear.forward = capture  # type: ignore[method-assign]
    engine.step()
    GGUFLinear.forward = lambda self, x: outputs[self]  # type: ignore[method-assign]
    result["step_without_linears"] = cpu_ms(engine.step, args.steps, args.repeats)
    GGUFLinear.forward = forward  # type: ignore[method-assign]

    def linears() -> None:
        for layer, x in inputs.items():
            layer(x)

    result["num_linears"] = len(inputs)
    result["linears"] = cpu_ms(linears, max(1, args.steps // 4), args.repeats)
    per_shape: dict[str, GGUFLinear] = {}
    for layer in inputs:
        per_shape.setdefault(f"{layer.out_features}x{layer.in_features} type {layer.block_type}", layer)
    result["per_call_us"] = {
        shape: {
            key: round(ms * 1e3, 2)
            for key, ms in cpu_ms(lambda layer=layer: layer(inputs[layer]), 8 * args.steps, args.repeats).items()
        }
        for shape, layer in per_shape.items()
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
