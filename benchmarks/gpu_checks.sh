#!/usr/bin/env bash
# The GPU checks (issue 36): the CUDA tests and the encoder, ingest and index-build
# benchmarks, on one machine with a CUDA GPU, each step bounded and logged.
#
#   OUT=gpu-out bash benchmarks/gpu_checks.sh          # every step
#   OUT=gpu-out bash benchmarks/gpu_checks.sh tests    # some steps: tests, cuda, cpu,
#                                                      # cuda-large, index
#
# Needs: a python whose torch sees CUDA, memlm's dependencies importable (the bundled
# model and corpus too; faiss-cpu is enough: faiss-gpu is only used for IVF-PQ training),
# and the repository as the working directory. Every log lands in $OUT/<step>.log, and
# the tail of each is printed. The CPU step runs the same benchmark on the same machine's
# cores, so the speed-ups are read within one run. docs/memory.md ("On a GPU") has the
# tables of the last run and the command that made them.
set -u
OUT=${OUT:-gpu-out}
THREADS=${THREADS:-$(nproc)}
PY=${PY:-python3}
mkdir -p "$OUT"
# The tests run the encoder in float32 (tests/conftest.py sets this; --noconftest below
# keeps the database and Milvus fixtures, which the GPU tests do not use, out).
export MEMLM_PRECISION=float32 PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run, log, print the tail
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "-- $name: rc=$rc in $((SECONDS - t0)) s"
    grep -v -e "Loading weights" -e "it/s\]" "$OUT/$name.log" | tail -n 30
}

steps=("$@")
run() { [ ${#steps[@]} -eq 0 ] || [[ " ${steps[*]} " == *" $1 "* ]]; }

if run tests; then
    step gpu-tests 240 "$PY" -m pytest -q -m gpu --noconftest -p no:cacheprovider \
        tests/test_device.py
fi
if run cuda; then  # the three precisions of the GPU, 8 windows of 512 a forward
    step encoder-cuda 180 "$PY" benchmarks/bench_encoder.py --device cuda \
        --threads "$THREADS" --docs 12 --memory-docs 20 --repeat 3 --batch-size 8
fi
if run cpu; then  # the baseline: the same benchmark on this machine's CPU cores
    step encoder-cpu 180 "$PY" benchmarks/bench_encoder.py --device cpu \
        --threads "$THREADS" --docs 12 --memory-docs 20 --repeat 2 --batch-size 1 \
        --precisions float32,bfloat16
fi
if run cuda-large; then  # the same with a larger memory: what the memory's search costs
    step encoder-cuda-large 150 "$PY" benchmarks/bench_encoder.py --device cuda \
        --threads "$THREADS" --docs 12 --memory-docs 300 --repeat 2 --batch-size 8 \
        --precisions float32,bfloat16 --ppl-docs 2
fi
if run index; then  # IVF-PQ build and search at 1M entries (faiss on the CPU cores)
    step index-1m 150 "$PY" benchmarks/bench_index.py --sizes 1000000 --threads "$THREADS"
fi
