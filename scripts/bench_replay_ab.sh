#!/usr/bin/env bash
# One router setting off and on under the same replay: `pdmesh up --prefill 2 --decode 1` is
# started once per value of PDMESH_ROUTER_<SETTING>, the first LIMIT requests of the
# conversation trace are replayed with `--time-scale SCALE`, and each run's failures, served
# rate, goodput, TTFT and prefix-cache hit rate (against the trace's ideal) are printed.
#   bench-burst:    MAX_QUEUED 100 0.01 0 1024        (a burst: refused vs queued for room)
#   bench-coalesce: COALESCE_WAIT_MS 200 1 0 30000    (overlapping requests sharing prefixes)
#   bench-grow:     RESERVE_TOKENS 100 0.01 0 64  (a burst asking for long answers: KV for all
#                   of max_tokens up front vs growing reservations)
# UP_ARGS adds flags to `pdmesh up` (bench-coalesce gives the KV-store room for the whole
# working set, so that eviction does not hide what coalescing changes), REPLAY_ARGS to
# `pdmesh replay`.
# Usage: scripts/bench_replay_ab.sh BIN_DIR SETTING LIMIT SCALE VALUE... (BIN_DIR: target/release)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 5 ] || { sed -n 2,14p "$0" >&2; exit 2; }
read -r -a up_args <<< "${UP_ARGS:-}"
read -r -a replay_args <<< "${REPLAY_ARGS:-}"
bin=$1 setting=$2 limit=$3 scale=$4
shift 4
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
trace=../shared/traces/conversation_trace.jsonl
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p .bench
for v in "$@"; do
  name="${setting,,}_$v"
  env "PDMESH_ROUTER_$setting=$v" "$bin/pdmesh" up --model "$model" --listen "127.0.0.1:$port" \
    --http-listen 127.0.0.1:0 --prefill 2 --decode 1 ${up_args[@]+"${up_args[@]}"} \
    > ".bench/replay_up_$name.log" 2>&1 &
  up=$!
  for _ in $(seq 120); do grep -q "mesh ready" ".bench/replay_up_$name.log" && break; sleep 1; done
  "$bin/pdmesh" replay --target "127.0.0.1:$port" --trace "$trace" --limit "$limit" \
    --time-scale "$scale" ${replay_args[@]+"${replay_args[@]}"} --json > ".bench/replay_$name.json"
  kill -INT "$up"; wait "$up" || true
  python3 - "$setting" "$v" ".bench/replay_$name.json" <<'PY'
import json, sys
setting, v, path = sys.argv[1:]
j = json.load(open(path))
r = j["results"]
print(f"{setting.lower()}={v}: {r['ok']} ok, {r['failed']} failed, {r['req_s']:.3f} req/s served, "
      f"goodput {r['goodput_req_s']:.3f} req/s, TTFT p50 {r['ttft_ms']['p50']:.0f} "
      f"p99 {r['ttft_ms']['p99']:.0f} ms, hit rate {j['hit_rate']:.3f} of ideal "
      f"{j['ideal_hit_rate']:.3f} ({100 * j['hit_vs_ideal']:.1f}%), {r['output_tokens']} output "
      f"tokens ({r['output_tok_s']:.1f}/s), {r['preemptions']} preemptions; errors {r['errors']}")
PY
done
