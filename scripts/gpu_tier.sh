#!/usr/bin/env bash
# The CUDA backend's hardware tier in one run, on a GPU machine that has the driver but not
# necessarily Rust, a network or the model file (this workplace's lent H200: 64 MiB travel per
# call, the working tree included). From the repository root, with .gpu-bundle/ from
# `just gpu-bundle` beside it:
#
#   scripts/gpu_tier.sh          GPU 0: the CUDA test suites, then scripts/bench_gpu.py
#   scripts/gpu_tier.sh --emu    the same steps on the emulated device, the bench on the CPU
#                                with small shapes: checks the plumbing on a machine without one
#
# It unpacks the bundle into $PDMESH_TIER_WORK (default /tmp/pdmesh-tier), seeds a SmolLM2-shaped
# and a 1B-shaped model from the shapes in the bundle (`pdmesh synth-model`: the real vocabulary,
# shapes and formats, random weights), finds NVRTC and ptxas, and runs each step under its own
# time limit, going on past a failed one. Everything lands in $OUT (default .gpu-tier-out):
# tier.log (all output), bench.json (the numbers), summary.txt (each step's status and time).
# The exit status is 0 only when every step passed.
set -uo pipefail

mode=gpu
case "${1:-}" in
    "") ;;
    --emu) mode=emu ;;
    -h | --help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $0 [--emu]" >&2; exit 2 ;;
esac

root=$(pwd)
bundle=$root/.gpu-bundle
work=${PDMESH_TIER_WORK:-/tmp/pdmesh-tier}
out=${OUT:-$root/.gpu-tier-out}
[ -f "$bundle/bundle.tar.xz" ] || { echo "no $bundle/bundle.tar.xz: run \`just gpu-bundle\` first (and carry .gpu-bundle)" >&2; exit 2; }
[ -f scripts/bench_gpu.py ] || { echo "run from the repository root" >&2; exit 2; }
mkdir -p "$out"
rm -rf "$work" && mkdir -p "$work"
exec > >(tee "$out/tier.log") 2>&1
summary=$out/summary.txt
: > "$summary"
failed=0

# step NAME SECONDS COMMAND...: runs it under a limit, records status and wall time.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    [ "$mode" = emu ] && limit=$((limit * 4))
    echo "=== $(date +%T) $name (limit ${limit}s): $*"
    start=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    local took
    took=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)")
    local verdict=passed
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT"
    [ $rc -ne 0 ] && [ "$verdict" = passed ] && verdict="FAILED (exit $rc)"
    [ $rc -ne 0 ] && failed=$((failed + 1))
    printf '%-16s %-18s %8ss\n' "$name" "$verdict" "$took" | tee -a "$summary"
}

echo "=== $(date -u +%FT%TZ) hardware tier ($mode) on $(uname -n), bundle: $(cat "$bundle/manifest.txt" 2>/dev/null | head -1)"
# Python's tarfile, not tar -J: a bare image may lack the xz program.
python3 -c '
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
' "$bundle/bundle.tar.xz" "$work" || { echo "cannot unpack the bundle" >&2; exit 2; }
export LD_LIBRARY_PATH="$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -d /usr/local/nvidia/lib64 ] && LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/usr/local/nvidia/lib64"
bin=$work/bin

# NVRTC: cudarc looks for libnvrtc.so (or .so.12 and older); CUDA 13 installs libnvrtc.so.13.
# PDMESH_NVRTC names one outright.
nvrtc=${PDMESH_NVRTC:-}
[ -z "$nvrtc" ] && nvrtc=$(ldconfig -p 2>/dev/null | awk '/libnvrtc\.so\.[0-9]+ /{print $NF; exit}')
if [ -z "$nvrtc" ]; then
    nvrtc=$(find "${CUDA_HOME:-/usr/local/cuda}/" /usr/local /usr/lib /opt /root/.local \
        -name 'libnvrtc.so.[0-9]*' -not -name '*alt*' 2>/dev/null | sort -V | tail -1)
fi
[ -z "$nvrtc" ] && [ -f "$root/.bench/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ] &&
    nvrtc=$root/.bench/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12
if [ -n "$nvrtc" ]; then
    mkdir -p "$work/nvrtc"
    ln -sf "$(readlink -f "$nvrtc")" "$work/nvrtc/libnvrtc.so"
    # NVRTC finds its builtins library beside itself through the loader path.
    export LD_LIBRARY_PATH="$work/nvrtc:$(dirname "$(readlink -f "$nvrtc")"):$LD_LIBRARY_PATH"
    echo "NVRTC: $nvrtc"
else
    echo "NVRTC: not found (the compile step and every CUDA step will say so)"
fi
ptxas=${PDMESH_PTXAS:-$(command -v ptxas || ls "${CUDA_HOME:-/usr/local/cuda}/bin/ptxas" 2>/dev/null || true)}
[ -z "$ptxas" ] && ptxas=$root/.bench/nvrtc/nvidia/cuda_nvcc/bin/ptxas
if [ -x "$ptxas" ]; then export PDMESH_PTXAS=$ptxas && echo "ptxas: $ptxas"; else unset PDMESH_PTXAS; fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv

export PDMESH_CUDA_TEST_DEVICE=$mode PDMESH_LOG=${PDMESH_LOG:-warn}
smollm2=$work/smollm2-synth.gguf
llama1b=$work/llama3-1b-synth.gguf
step synth-models 45 bash -c "
    '$bin/pdmesh-tools' synth-model --like '$work/smollm2.shape.gguf' --out '$smollm2' &&
    '$bin/pdmesh-tools' synth-model --like '$work/llama3-1b.shape.gguf' --out '$llama1b'"
export PDMESH_TEST_MODEL=$smollm2

# The test binaries take libtest's arguments; the mesh test finds pdmesh at ../pdmesh.
t=$bin/deps
# CI=true: without NVRTC or ptxas the test fails instead of skipping.
step nvrtc-compile 45 env CI=true "$t/cuda_nvrtc" --nocapture
step kernels 60 "$t/cuda_backend"
if [ "$mode" = gpu ]; then
    step bench 240 python3 scripts/bench_gpu.py --pdmesh "$bin/pdmesh" \
        --models "$smollm2" "$llama1b" --json-out "$out/bench.json"
else
    step bench 240 python3 scripts/bench_gpu.py --pdmesh "$bin/pdmesh" --backend cpu \
        --models "$smollm2" --prompt-tokens 32,64 --batch-sizes 1,4 --repeats 1 \
        --kv-tokens 256 --json-out "$out/bench.json"
fi
step whole-model 60 "$t/cuda_model" --nocapture
# The bounded kernels (tensor cores, flash attention) on K-quant weights (SmolLM2's are Q4_1
# and Q8_0): the 1B shape's Q4_K/Q6_K.
step bounded-1b 75 env PDMESH_TEST_MODEL="$llama1b" "$t/cuda_model" bounded_kernels --nocapture
step mixed-mesh 75 "$t/mesh_equivalence" cuda_prefill

echo "=== $(date +%T) done: $failed step(s) failed"
cat "$summary"
[ "$failed" -eq 0 ]
