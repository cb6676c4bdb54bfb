#!/usr/bin/env python3
"""The prefix cache, in one run.

1. Cold vs cached: TTFT of a prompt made of a --system-tokens (2,000) shared system prompt and
   a short question, through 1 prefill + 1 decode node and a KV-store. Cold: each request has a
   system prompt nothing has seen (a new prefix seed). Cached: questions after a system prompt
   computed before, once served from the prefill node's own tier and once with that tier off
   (`--cache-bytes 0`), so every block comes from the KV-store process. Medians; the ratio is
   cold over cached (goal >= 5).

2. Replay: the first --limit (1,000) requests of the conversation trace through 2 prefill nodes,
   1 decode node and a KV-store, once per placement policy (round-robin, least-load,
   prefix-aware) and KV-store budget: one that holds the trace's working set (every distinct
   block, computed from the file) and a quarter of it. Prints the achieved token hit rate
   against the ideal one (an infinite cache with no delay, from the file), TTFT percentiles and
   goodput. The trace's blocks of 512 tokens become blocks of --block-size tokens
   (token scale = block size / 512) so that its 1,000 prompts (121,924 tokens at most) fit the
   model and this machine's two cores; arrival times are scaled by --time-scale.

Absolute times drift on a shared machine; compare within one run. Raw reports go to
.bench/prefix.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_mesh import BIN, Mesh, bench  # noqa: E402

TRACE = "../shared/traces/conversation_trace.jsonl"
POLICIES = ("round-robin", "least-load", "prefix-aware")


def cold_vs_cached(a, report):
    print(f"1. cold vs cached: {a.system_tokens}-token system prompt + {a.question_tokens}-token question",
          file=sys.stderr)
    common = ["--concurrency", "1", "--shared-prefix-tokens", str(a.system_tokens),
              "--prompt-tokens", str(a.question_tokens), "--max-tokens", "2"]
    rows = {}
    for tier, extra in (("own tier", []), ("KV-store", ["--cache-bytes", "0"])):
        with Mesh(["--prefill", "1", "--decode", "1"] + extra, a.model) as m:
            t = ["--target", m.addr]
            bench(t + ["--requests", "1", "--prompt-tokens", "16", "--max-tokens", "2"])  # warm-up
            cold = [bench(t + common + ["--requests", "1", "--prefix-seed", str(1000 + i), "--seed", str(i)])
                    for i in range(a.reps)]
            cached = bench(t + common + ["--requests", str(a.reps), "--prefix-seed", "1000", "--seed", "99"])
            rows[tier] = {
                "cold_ttft_ms": statistics.median(r["results"]["ttft_ms"]["p50"] for r in cold),
                "cold_cached_tokens": max(r["results"]["cached_tokens"]["p99"] for r in cold),
                "cached_ttft_ms": cached["results"]["ttft_ms"]["p50"],
                "cached_tokens": cached["results"]["cached_tokens"]["p50"],
                "raw": {"cold": cold, "cached": cached},
            }
    report["cold_vs_cached"] = rows
    print(f"\n== TTFT, {a.system_tokens}-token system prompt + {a.question_tokens}-token question "
          f"(medians of {a.reps}) ==")
    print(f"{'cached from':12} {'cold ms':>9} {'cached ms':>10} {'cached tokens':>14} {'cold/cached':>12}")
    for tier, r in rows.items():
        ratio = r["cold_ttft_ms"] / r["cached_ttft_ms"]
        r["ratio"] = ratio
        print(f"{tier:12} {r['cold_ttft_ms']:>9.1f} {r['cached_ttft_ms']:>10.1f} {r['cached_tokens']:>14.0f} "
              f"{ratio:>12.2f}  (goal >= 5)")


def working_set(limit, bytes_per_block):
    """Distinct full blocks the first `limit` requests reference, and what they take."""
    seen = set()
    with open(TRACE) as f:
        for line, _ in zip(f, range(limit)):
            r = json.loads(line)
            seen.update(r["hash_ids"][: r["input_length"] // 512])
    return len(seen), len(seen) * bytes_per_block


def replay(a, report):
    # f16 K and V of every layer: 30 layers x 3 KV heads x 64 dims x 2 x 2 bytes per token.
    bytes_per_block = 23040 * a.block_size
    blocks, ws = working_set(a.limit, bytes_per_block)
    budgets = {"working set": int(ws * 1.05), "quarter": ws // 4}
    print(f"2. replay: {a.limit} requests, working set {blocks} blocks = {ws / 1e9:.2f} GB", file=sys.stderr)
    rows = []
    for budget_name, budget in budgets.items():
        for policy in POLICIES:
            print(f"  {budget_name} budget ({budget / 1e9:.2f} GB), {policy}", file=sys.stderr)
            args = ["--prefill", "2", "--decode", "1", "--block-size", str(a.block_size),
                    "--kv-blocks", str(a.kv_blocks), "--kvstore-budget-bytes", str(budget),
                    "--prefill-policy", policy]
            with Mesh(args, a.model) as m:
                out = subprocess.run(
                    [BIN, "replay", "--json", "--target", m.addr, "--trace", TRACE, "--limit", str(a.limit),
                     "--token-scale", str(a.block_size / 512), "--time-scale", str(a.time_scale),
                     "--max-output-tokens", str(a.max_output_tokens)],
                    check=True, capture_output=True, text=True)
            r = json.loads(out.stdout)
            rows.append({"budget": budget_name, "budget_bytes": budget, "policy": policy, "report": r})
    report["replay"] = {"working_set_blocks": blocks, "working_set_bytes": ws, "runs": rows}
    ideal = rows[0]["report"]["ideal_hit_rate"]
    print(f"\n== replay: first {a.limit} requests of the conversation trace, 2 prefill + 1 decode, "
          f"time x{a.time_scale}; ideal hit rate {ideal:.3f} ==")
    print(f"{'KV-store budget':22} {'policy':13} {'hit rate':>9} {'of ideal':>9} {'TTFT p50':>9} "
          f"{'p99':>9} {'goodput':>8} {'failed':>7}")
    for row in rows:
        r = row["report"]
        q = r["results"]
        b = f"{row['budget']} ({row['budget_bytes'] / 1e9:.2f} GB)"
        print(f"{b:22} {row['policy']:13} {r['hit_rate']:>9.3f} {100 * r['hit_vs_ideal']:>8.1f}% "
              f"{q['ttft_ms']['p50']:>9.0f} {q['ttft_ms']['p99']:>9.0f} {q['goodput_req_s']:>8.2f} {q['failed']:>7}")
    print("goal: >= 95% of ideal with the working-set budget; TTFT in ms, goodput in requests/s within the SLOs")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=8192, help="decode node KV blocks in the replay")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-output-tokens", type=int, default=2)
    ap.add_argument("--parts", default="cached,replay")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    report = {}
    if "cached" in parts:
        cold_vs_cached(a, report)
    if "replay" in parts:
        replay(a, report)
    os.makedirs(".bench", exist_ok=True)
    with open(".bench/prefix.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
