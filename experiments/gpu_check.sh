#!/usr/bin/env bash
# What a CPU cannot check, in one pass on a CUDA machine (about 4 minutes on an H200 before the tuned products were
# added to step 6 and step 7 was added, which may take 3-4 more; 16 at most; steps 1-3 and 5 side by side, then
# 4, 6 and 7 alone). Where one call may run 10 minutes at most, split it: STEPS="gpu_tests compile run parity
# bench_attention decode_tiles", then STEPS="e2e skinny".
#   1. the gpu-marked tests: every backend against the float64 reference on CUDA, Triton's split-key
#      path on long contexts, torch_paged's masked GQA groups with SDPA's math kernel off, flash_attn
#      when installed, every backend on cuda:1 when there are two GPUs, async scheduling against synchronous;
#   2. the Triton kernels compiled for this GPU's architecture;
#   3. an engine run per backend on the GPU (the triton one must run compiled: no interpreter notice),
#      and on cuda:1 when there are two GPUs;
#   4. the attention benchmark on a reduced grid (the full default grid: python experiments/bench_attention.py),
#      and the decode launch of the e2e model's heads at batch 32 over key-tile sizes, splits and warps against
#      the plan its graphs capture (experiments/bench_decode_tiles.py);
#   5. greedy parity with transformers on CUDA, every backend x bf16/fp16/fp32, CUDA graphs as by default
#      (experiments/gpu_e2e.py parity);
#   6. a random 1.1B Llama in bf16 at batch 32 and 128: LLM.generate against HF generate, CUDA graphs and
#      the fused operators and async scheduling on and off, executor.decode_matmul=tuned (with its table of
#      timed products), executor.weight_prefetch_mb=12, 24 and 48 (the next weights asked of L2 by
#      the fused operators), the Triton backend's fuse_rotary (RoPE in the decode attention launch) alone
#      and with 24 MiB of prefetch, the decode step against the HBM roofline, the graph replay at the step's own context
#      bound and at max_model_len's (key splits), and profiles of a step's host side, and by kernel of its
#      graph replay and of whole decode steps (experiments/gpu_e2e.py speed --profile);
#   7. that model's matrix products at 32 and 128 rows, cuBLAS and cuBLASLt against the split-K Triton kernel of
#      models/cuda_matmul.py over its 40 configurations, the fastest also with its K splits summed by a second
#      launch (experiments/bench_skinny_matmul.py).
# Usage: bash experiments/gpu_check.sh [LOG_DIR]   (default: $OUT if set, else ./gpu_check_logs)
# On the lent GPU machines (python3 with CUDA torch, no network) step 3 needs hydra-core and omegaconf: make
# .whl here with experiments/gpu_wheels.sh and carry it; this script installs it (without, step 3 is skipped).
# STEPS="parity e2e" runs only the steps whose names contain one of those words (two device calls, say).
# E2E_CASES="default,prefetch12" and E2E_BATCHES=32 narrow step 6 (gpu_e2e.py speed --cases/--batches) when time is short.
# DEADLINE_S=540 ends the whole check within 540 s of its start: each step's limit is cut to what is left (one
# left under 15 s is skipped, status 124), so a device call's logs come back even when a step runs long.
# Each step is time-limited, logs to LOG_DIR/<step>.log, and a failed step does not stop the others;
# the exit status is the number of failed steps; LOG_DIR/summary.txt has the figures. The device tool brings
# back at most 8 files from $OUT: there, log to another folder and put it in $OUT as one archive.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/servelab_site \
        .whl/*.whl && export PYTHONPATH=/tmp/servelab_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG_DIR=${1:-${OUT:-gpu_check_logs}}
mkdir -p "$LOG_DIR"
START=$(date +%s)

. experiments/gpu_step.sh  # step NAME SECONDS COMMAND...

"$PY" - <<'EOF' | tee "$LOG_DIR/device.log"
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} sm_{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB {p.multi_processor_count} SMs")
EOF
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
ARCH=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(10 * m + n)")
if [ "$GPUS" -lt 1 ]; then
    echo "no CUDA device: nothing to check here"
    exit 1
fi

# Phase 1, correctness, side by side (16 CPU cores, one GPU): every engine here gets a fixed KV budget, so
# none sizes its pool off memory another process holds at that moment.
# The folders whose modules import nothing beyond the GPU image (tests/framework/harness needs hydra).
WORKERS=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")  # pytest-xdist where installed
step gpu_tests 200 "$PY" -m pytest -rfEs -p no:randomly -p no:cacheprovider $WORKERS -m gpu tests/backends \
    tests/models tests/framework/execution tests/framework/engine &
step compile_sm"$ARCH" 200 env -u TRITON_INTERPRET "$PY" -m tests.backends.gpu_compile "$ARCH" &
HAS_HYDRA=$("$PY" -c "import hydra, omegaconf, orjson" 2>/dev/null && echo 1 || echo 0)
[ "$HAS_HYDRA" = 1 ] || echo "== run_*: skipped (no hydra-core/omegaconf/orjson: bash experiments/gpu_wheels.sh, carry .whl)"
for backend in $([ "$HAS_HYDRA" = 1 ] && echo torch_paged triton naive); do
    step "run_$backend" 180 "$PY" -m framework.run backend="$backend" engine.device=cuda engine.dtype=bfloat16 \
        engine.kv_cache_memory_gb=4 workload.num_requests=16 &
done
if [ "$GPUS" -ge 2 ] && [ "$HAS_HYDRA" = 1 ]; then
    step run_triton_cuda1 180 "$PY" -m framework.run backend=triton engine.device=cuda:1 engine.dtype=bfloat16 \
        engine.kv_cache_memory_gb=4 workload.num_requests=16 &
fi
step parity 200 "$PY" experiments/gpu_e2e.py parity --kv-cache-gb 8 &
wait
for backend in torch_paged triton naive; do
    if grep -q "Triton's interpreter" "$LOG_DIR/run_$backend.log" 2>/dev/null; then
        echo "   run_$backend FAILED: it ran through Triton's interpreter on a GPU"
        echo 1 >"$LOG_DIR/run_$backend.status"
    fi
done

# Phase 2, timing, one step at a time on an otherwise idle GPU.
step bench_attention 100 "$PY" experiments/bench_attention.py --iters 10 --decode-batches 1,64,256 \
    --decode-contexts 1024,16384 --prefill-batches 1,8 --prefill-lens 1024
step decode_tiles 150 "$PY" experiments/bench_decode_tiles.py
step e2e 420 "$PY" experiments/gpu_e2e.py speed --batches "${E2E_BATCHES:-32,128}" --profile \
    ${E2E_CASES:+--cases "$E2E_CASES"}
step skinny_matmul 180 "$PY" experiments/bench_skinny_matmul.py

failed=$(cat "$LOG_DIR"/*.status 2>/dev/null | grep -cv '^0$')
grep -hE "passed|failed" "$LOG_DIR/gpu_tests.log" 2>/dev/null | tail -n 1 >"$LOG_DIR/summary.txt"
grep -hE "^(PARITY|E2E|KERNELS|STEPKERNELS|MATMUL|TILES|device|decode|prefill)" "$LOG_DIR"/parity.log "$LOG_DIR"/e2e.log \
    "$LOG_DIR"/bench_attention.log "$LOG_DIR"/decode_tiles.log "$LOG_DIR"/skinny_matmul.log 2>/dev/null >>"$LOG_DIR/summary.txt"

echo "== $failed step(s) failed; logs in $LOG_DIR"
exit "$failed"
