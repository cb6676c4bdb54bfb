#!/usr/bin/env python3
"""KV transfer, in one run.

1. Bandwidth: `pdmesh bench kv` moves the KV of a --tokens prompt (4,096 tokens: ~94 MB in f16)
   from this process into a decode node process by UCX as the nodes run it (on one host: a
   memcpy into the decode node's pool, shared memory this process maps), by UCX puts into a
   private pool (`--kv-shared-pool false`, as between hosts), and by the gRPC stream, timing
   open-to-commit; the reference is an in-process memcpy of the same bytes. Medians; ratios
   against memcpy (goals: UCX >= 0.80, gRPC >= 0.30).

2. Overlap: TTFT and time to the second token of a --ttft-tokens prompt (2,048) through
   1 prefill + 1 decode node over UCX, with the KV pushed layer by layer while later layers
   compute (`--kv-push layer`), after each chunk (`chunk`), and only after the whole prompt
   (`prompt`, the reference). The first token leaves the prefill node at once in every mode; the
   second needs the whole KV on the decode node, so the transfer left after the prefill
   ("transfer tail", from the request's timings) is what the overlap hides.

3. Against another build (`--reference PATH`, a `pdmesh` binary with its `pdmesh-tools` beside
   it): part 1's transfers by this build and by that one, alternating for --rounds rounds, with
   the ratio of each transport's median time (this build / the reference; goal <= 1.05, e.g.
   UCX access scoped per reservation against one registration of the whole pool).

Writes the raw reports to .bench/kv.json.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_mesh import BIN, Mesh, bench  # noqa: E402
import subprocess  # noqa: E402


def kv_bench(binary, a):
    out = subprocess.run([binary, "bench", "kv", "--json", "--model", a.model, "--tokens", str(a.tokens),
                          "--reps", str(a.reps)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def compare(a, report):
    """This build's KV transfers against the reference build's, alternating rounds."""
    import statistics
    print(f"3. this build vs {a.reference}: KV of {a.tokens} tokens, {a.rounds} rounds", file=sys.stderr)
    runs = {"this": [], "reference": []}
    for i in range(a.rounds):
        # Alternate which goes first, so neither always runs on the warmer (or busier) machine.
        order = [("this", BIN), ("reference", a.reference)]
        for name, binary in order if i % 2 == 0 else reversed(order):
            runs[name].append(kv_bench(binary, a))
    report["compare"] = runs
    print(f"\n== this build vs {a.reference} (medians of {a.rounds} rounds' medians) ==")
    # Each run's time over its own memcpy as well: the machine's drift between runs cancels.
    print(f"{'path':8} {'this ms':>9} {'ref ms':>9} {'this/ref':>9} {'per memcpy':>11}")
    for name, key in (("ucx", "ucx"), ("ucx-put", "ucx_put"), ("grpc", "grpc"), ("memcpy", "memcpy")):
        if any(r.get(f"{key}_ms") is None for r in runs["this"] + runs["reference"]):
            print(f"{name:8} (not measured by both builds)")
            continue
        t = statistics.median(r[f"{key}_ms"] for r in runs["this"])
        r = statistics.median(r[f"{key}_ms"] for r in runs["reference"])
        tn = statistics.median(r[f"{key}_ms"] / r["memcpy_ms"] for r in runs["this"])
        rn = statistics.median(r[f"{key}_ms"] / r["memcpy_ms"] for r in runs["reference"])
        goal = "" if key == "memcpy" else "  (goal <= 1.05)"
        print(f"{name:8} {t:>9.2f} {r:>9.2f} {t / r:>9.3f} {tn / rn:>11.3f}{goal}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ttft-tokens", type=int, default=2048)
    ap.add_argument("--ttft-requests", type=int, default=5)
    ap.add_argument("--parts", default="bandwidth,overlap")
    ap.add_argument("--reference", help="another build's pdmesh binary to compare part 1 against (part 3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds in part 3")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    report = {}
    if "bandwidth" in parts:
        print(f"1. bandwidth: KV of {a.tokens} tokens, {a.reps} timed transfers each", file=sys.stderr)
        out = subprocess.run([BIN, "bench", "kv", "--json", "--model", a.model, "--tokens", str(a.tokens),
                              "--reps", str(a.reps)], check=True, capture_output=True, text=True)
        r = json.loads(out.stdout)
        report["bandwidth"] = r
        print(f"\n== KV of {r['tokens']} tokens ({r['bytes'] / 1e6:.1f} MB) into a decode node process (medians) ==")
        print(f"{'path':8} {'ms':>9} {'GB/s':>8} {'vs memcpy':>10}")
        for name, key, goal in (("memcpy", "memcpy", None), ("ucx", "ucx", 0.80), ("ucx-put", "ucx_put", None),
                                ("grpc", "grpc", 0.30)):
            ratio = 1.0 if key == "memcpy" else r[f"{key}_vs_memcpy"]
            g = "" if goal is None else f"  (goal >= {goal:.2f})"
            print(f"{name:8} {r[f'{key}_ms']:>9.2f} {r[f'{key}_gbps']:>8.2f} {ratio:>10.3f}{g}")
        print("ucx: as the nodes run it (one host: memcpy into the decode node's shared pool); "
              "ucx-put: UCX puts into a private pool, as between hosts")
    if a.reference:
        compare(a, report)
    if "overlap" in parts:
        print(f"2. overlap: {a.ttft_tokens}-token prompts, UCX, by push mode", file=sys.stderr)
        rows = {}
        for push in ("layer", "chunk", "prompt"):
            with Mesh(["--prefill", "1", "--decode", "1", "--threads", "1", "--kv-transport", "ucx",
                       "--kv-push", push], a.model) as m:
                bench(["--target", m.addr, "--requests", "1", "--prompt-tokens", "16", "--max-tokens", "2"])
                rows[push] = bench(["--target", m.addr, "--requests", str(a.ttft_requests), "--concurrency", "1",
                                    "--prompt-tokens", str(a.ttft_tokens), "--max-tokens", "2"])
        report["overlap"] = rows
        print(f"\n== {a.ttft_tokens}-token prompt over UCX, medians of {a.ttft_requests} ==")
        print(f"{'push':8} {'TTFT ms':>9} {'prefill ms':>11} {'transfer tail ms':>17} {'2nd token ms':>13}")
        for push, r in rows.items():
            q = r["results"]
            print(f"{push:8} {q['ttft_ms']['p50']:>9.1f} {q['prefill_ms']['p50']:>11.1f} "
                  f"{q['transfer_ms']['p50']:>17.2f} {q['e2e_ms']['p50']:>13.1f}")
        tail = {k: v["results"]["transfer_ms"]["p50"] for k, v in rows.items()}
        if tail["prompt"] > 0:
            print(f"layer-wise push leaves {tail['layer']:.2f} ms of the {tail['prompt']:.2f} ms transfer after the "
                  f"prefill: {100 * (1 - tail['layer'] / tail['prompt']):.0f}% hidden")
    os.makedirs(".bench", exist_ok=True)
    with open(".bench/kv.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
