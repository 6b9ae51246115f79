"""Embeddings in one process: our engine and sentence-transformers alternated on the same texts.

bench/embed.py runs every system in a fresh process, so on a machine shared with other work its ratios move
with the load between runs. This script loads all-MiniLM-L6-v2 once in our engine and once in
sentence-transformers, then alternates them ``--rounds`` times over the same texts (bench/embed.py's
workload: lengths uniform in 5..256 tokens), tokenization included in each run's time, so neighbouring
runs see about the same load. With ``--torch-path`` a third system is our engine with its C++ kernels
switched off (``nn.Linear``, ``scaled_dot_product_attention`` per run of equal lengths, torch's LayerNorm
and GELU), the path used where the kernels are unavailable.

Per system: the median texts/s and elapsed seconds, the median process CPU seconds (all threads; less
sensitive to other processes than wall time), and for ours the fraction of the machine's arithmetic limit
(bench/embed.py's FLOPs over median elapsed x the float32 peak measured here: bench/arithmetic.py), also
computed from CPU time (FLOPs over CPU seconds x one core's peak in GFLOP per CPU second), which a loaded
machine distorts less.
``min_cosine``: least cosine between our embeddings and sentence-transformers'.

Usage: python bench/embed_alternate.py [--num-texts 200] [--rounds 3] [--threads 2] [--torch-path]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from arithmetic import calibrate_peak  # noqa: E402
from embed import make_texts, workload_flops  # noqa: E402
from embed_peer import ST_BATCH_SIZE  # noqa: E402

from jobs.config import BUILTIN_EMBEDDING_MODEL  # noqa: E402
from worker.engine.executor.layers.onednn_linear import (  # noqa: E402
    onednn_linear_available,
    pack_linear_weight,
    packed_linear,
)
from worker.model_prepare import prepare_model  # noqa: E402


def _cpu_time_peak(size: int = 1024, reps: int = 5) -> float:
    """GFLOP per CPU second of a float32 ``size``-cubed product on one thread, the better of ``torch.matmul``
    (MKL) and oneDNN with a prepacked weight (best of ``reps`` each; bench/arithmetic.py's candidates): the
    one-core peak measured in CPU time, which other processes on the machine inflate far less than wall time."""
    generator = torch.Generator().manual_seed(0)
    a, w = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    candidates: list[Callable[[], torch.Tensor]] = [lambda: torch.matmul(a, w.T)]
    if onednn_linear_available():
        packed = pack_linear_weight(w, size)
        candidates.append(lambda: packed_linear(a, packed, None))
    best = float("inf")
    for run in candidates:
        run()
        for _ in range(reps):
            start = time.process_time()
            run()
            best = min(best, time.process_time() - start)
    return 2.0 * size**3 / best / 1e9


def _set_cpu_kernels(model: torch.nn.Module, enabled: bool) -> None:
    from worker.engine.executor.models.bert import BertEmbeddings, BertLayer

    for module in model.modules():
        if isinstance(module, (BertEmbeddings, BertLayer)):
            module.use_cpu_kernels = enabled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-texts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--torch-path", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from worker.engine.pooling_engine import build_embedding_engine

    model_dir = prepare_model(BUILTIN_EMBEDDING_MODEL)
    texts, lengths = make_texts(model_dir, args.num_texts)
    engine = build_embedding_engine(model_dir)
    kernels_on = any(getattr(m, "use_cpu_kernels", False) for m in engine.model.modules())
    st_model = SentenceTransformer(str(model_dir), device="cpu")

    def ours() -> np.ndarray:
        token_ids = engine.tokenizer(texts, truncation=True, max_length=engine.max_model_len)["input_ids"]
        return engine.embed(token_ids).numpy()

    def ours_torch() -> np.ndarray:
        _set_cpu_kernels(engine.model, False)
        try:
            return ours()
        finally:
            _set_cpu_kernels(engine.model, kernels_on)

    def st() -> np.ndarray:
        return np.asarray(st_model.encode(texts, batch_size=ST_BATCH_SIZE, convert_to_numpy=True))

    systems: dict[str, Callable[[], np.ndarray]] = {"batchinfer": ours, "st": st}
    if args.torch_path and kernels_on:
        systems["batchinfer_torch"] = ours_torch
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    outputs: dict[str, np.ndarray] = {}
    for name, run in systems.items():
        outputs[name] = run()  # warm-up: first touch, thread pools, the kernels' build
    for _ in range(args.rounds):
        for name, run in systems.items():
            wall, cpu = time.perf_counter(), time.process_time()
            outputs[name] = run()
            runs[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    peak = calibrate_peak(1024, 5)["peak_gflops"]
    torch.set_num_threads(1)
    peak_one_thread = _cpu_time_peak()
    flops = workload_flops(model_dir, lengths)
    a, b = outputs["batchinfer"], outputs["st"]
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    result: dict[str, object] = {"num_texts": len(texts), "num_tokens": sum(lengths), "threads": args.threads}
    for name, measured in runs.items():
        elapsed = statistics.median(wall for wall, _ in measured)
        cpu_s = statistics.median(cpu for _, cpu in measured)
        result[name] = {
            "texts_per_s": len(texts) / elapsed,
            "elapsed_s": [round(wall, 3) for wall, _ in measured],
            "cpu_s": [round(cpu, 3) for _, cpu in measured],
            "median_elapsed_s": elapsed,
            "median_cpu_s": cpu_s,
            "fraction_of_limit": flops / (elapsed * peak * 1e9),
            "fraction_of_limit_cpu_time": flops / (cpu_s * peak_one_thread * 1e9),
        }
    st_result = result["st"]
    assert isinstance(st_result, dict)
    for name in runs:
        entry = result[name]
        assert isinstance(entry, dict)
        entry["vs_st_wall"] = st_result["median_elapsed_s"] / entry["median_elapsed_s"]
        entry["vs_st_cpu"] = st_result["median_cpu_s"] / entry["median_cpu_s"]
    result.update(peak_gflops=peak, peak_gflops_per_cpu_s=peak_one_thread, kernels=kernels_on)
    result["min_cosine"] = float(cosine.min())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
