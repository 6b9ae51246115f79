#!/usr/bin/env bash
# GPU checks (opt-in; needs a CUDA device and the `gpu` extra, i.e. triton==3.7.1):
#   1. the Triton kernels against their PyTorch twins, natively on CUDA, and the engine's dispatch to them;
#   2. the engine on CUDA against Hugging Face on the real model, float32 and bfloat16 (`gpu` marker);
#   3. bench/throughput.py on CUDA in bfloat16, beside HF `generate` on the same GPU in bfloat16.
# Prints one JSON object per check and a last summary line; exits non-zero on any mismatch.
# Usage: ./scripts/gpu_check.sh [--skip-bench]
#        BATCHINFER_GPU_CHECKS=kernels ./scripts/gpu_check.sh   # only the named checks (comma-separated)
#        ./scripts/gpu_check.sh --interpret   # check 1's kernel parity only, in Triton's interpreter (no GPU)
# --interpret runs the comparison step on a CPU so that a test can prove this script fails on a mismatch:
# BATCHINFER_GPU_CHECK_SELECT narrows it to a pytest -k expression, and BATCHINFER_INJECT_KERNEL_FAULT=1
# makes the parity tests perturb the kernels' output before comparing (tests/kernels/test_triton.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
interpret=0
[ "${1:-}" = "--interpret" ] && interpret=1

if [ $interpret -eq 1 ]; then
    export TRITON_INTERPRET=1
else
    unset TRITON_INTERPRET
    if ! "$PYTHON" -c 'import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        echo '{"check": "cuda", "ok": false, "error": "no CUDA device, or torch/triton missing"}'
        exit 2
    fi
fi

failed=0
run_check() {  # name, command...
    local name=$1 start rc
    shift
    start=$(date +%s)
    "$@" >"/tmp/gpu_check_$name.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || failed=1
    printf '{"check": "%s", "ok": %s, "rc": %d, "elapsed_s": %d, "log": "/tmp/gpu_check_%s.log"}\n' \
        "$name" "$([ $rc -eq 0 ] && echo true || echo false)" "$rc" "$(($(date +%s) - start))" "$name"
    [ $rc -eq 0 ] || tail -n 30 "/tmp/gpu_check_$name.log" >&2
}

checks=",${BATCHINFER_GPU_CHECKS:-kernels,engine_parity,throughput},"
[ "${1:-}" = "--skip-bench" ] && checks=${checks/,throughput,/,}
wanted() { [[ $checks == *",$1,"* ]]; }

if [ $interpret -eq 1 ]; then
    run_check kernels "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_triton.py \
        -k "${BATCHINFER_GPU_CHECK_SELECT:-}"
    printf '{"check": "summary", "ok": %s}\n' "$([ $failed -eq 0 ] && echo true || echo false)"
    exit $failed
fi
wanted kernels && run_check kernels "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_triton.py \
    tests/worker/engine/executor/test_triton_dispatch.py tests/worker/engine/test_triton_engine.py
wanted engine_parity &&
    run_check engine_parity "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/worker/engine/test_gpu_parity.py
if wanted throughput; then
    run_check throughput "$PYTHON" bench/throughput.py --skip-vllm --rounds 2 --no-fidelity --device cuda --dtype bfloat16
    [ -s /tmp/gpu_check_throughput.log ] && grep '^{' /tmp/gpu_check_throughput.log | tail -n 1
fi
printf '{"check": "summary", "ok": %s}\n' "$([ $failed -eq 0 ] && echo true || echo false)"
exit $failed
