#!/usr/bin/env bash
# A burst against `pdmesh up --prefill 2 --decode 1`: the first 100 requests of the
# conversation trace replayed 100x faster (`pdmesh replay --time-scale 0.01`), once with the
# router's queue for room off (PDMESH_ROUTER_MAX_QUEUED=0: a request that finds no decode node
# with room is refused, as before) and once on (the default): failures, served rate and TTFT
# of each. Usage: scripts/bench_burst.sh [PDMESH_BINARY_DIR] (default target/release).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-target/release}"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
trace=../shared/traces/conversation_trace.jsonl
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p .bench
for q in 0 1024; do
  PDMESH_ROUTER_MAX_QUEUED=$q "$bin/pdmesh" up --model "$model" --listen "127.0.0.1:$port" \
    --http-listen 127.0.0.1:0 --prefill 2 --decode 1 > ".bench/burst_up_$q.log" 2>&1 &
  up=$!
  for _ in $(seq 120); do grep -q "mesh ready" ".bench/burst_up_$q.log" && break; sleep 1; done
  "$bin/pdmesh" replay --target "127.0.0.1:$port" --trace "$trace" --limit 100 \
    --time-scale 0.01 --json > ".bench/burst_$q.json"
  kill -INT "$up"; wait "$up" || true
  python3 - "$q" <<'PY'
import json, sys
q = sys.argv[1]
r = json.load(open(f".bench/burst_{q}.json"))["results"]
print(f"max_queued={q}: {r['ok']} ok, {r['failed']} failed, {r['req_s']:.3f} req/s served, "
      f"goodput {r['goodput_req_s']:.3f} req/s, TTFT p50 {r['ttft_ms']['p50']:.0f} "
      f"p99 {r['ttft_ms']['p99']:.0f} ms; errors {r['errors']}")
PY
done
