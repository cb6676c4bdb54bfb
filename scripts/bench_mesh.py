#!/usr/bin/env python3
"""The mesh against the engine alone, and disaggregation against colocation, in one run.

1. Overhead: the same requests (--overhead-prompt-tokens, 512 by default; 64 output tokens, one at a time) on one
   in-process engine (`pdmesh bench --engine-alone`) and through a mesh of 1 prefill + 1 decode
   node (`pdmesh up`, `pdmesh bench`), with the same thread count per engine. Prints medians of
   TTFT and inter-token latency and the mesh/engine ratio and difference. The mesh runs as
   `pdmesh up` does (mutual TLS on every hop, API keys) and, alternately for --rounds rounds,
   with `--insecure` (plaintext, no keys): the secure/insecure ratio is what security costs.
   `--parts tls` runs only those rounds (no engine-alone reference).

2. Disaggregation under a mixed load: --streams steady decode streams (each restarting a new
   request when one ends) run while long prompts arrive as a Poisson process. Once on 1 prefill + 1 decode node, each pinned to its own core
   with taskset (one compute thread each), once on one colocated decode node (no prefill node:
   it prefills prompts itself) with two threads over both cores, stall-free (prompt chunks
   sized to its --itl-target-ms), and once more unpaced (whole chunks) for reference. Prints p99 inter-token latency
   of the streams, TTFT of the prompts, and total output throughput of both.

3. Tracing: the same closed-loop load on 1 prefill + 1 decode node with tracing off (no OTLP
   endpoint) and on (every span exported, 100% sampling, to a `pdmesh collect` receiver on
   this machine), alternating off/on for --rounds rounds. Prints median throughput and latency
   of each and the on/off ratios.

Everything runs on this machine's cores; absolute numbers drift between runs, the ratios in one
run are what to compare. Writes the raw reports to .bench/mesh.json.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

BIN = "target/release/pdmesh"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mesh:
    def __init__(self, args, model, env=None):
        self.addr = f"127.0.0.1:{free_port()}"
        cmd = [BIN, "up", "--listen", self.addr, "--http-listen", "127.0.0.1:0", "--model", model] + args
        env = dict(os.environ, PDMESH_LOG="warn", **(env or {}))
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env)
        line = self.p.stdout.readline()
        if "ready" not in line:
            self.p.kill()
            raise SystemExit(f"mesh did not start: {line!r}")
        print(f"  {line.strip()}", file=sys.stderr)
        # `pdmesh bench` aimed at this router finds the mesh's credentials by itself; a
        # plaintext mesh needs plaintext clients.
        self.env = {"PDMESH_INSECURE": "1"} if "--insecure" in args else {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.p.terminate()
        self.p.wait(timeout=30)


def bench(args, env=None):
    env = dict(os.environ, **(env or {}))
    out = subprocess.run([BIN, "bench", "--json"] + args, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout)


def main():
    global BIN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per engine in part 1")
    ap.add_argument("--requests", type=int, default=8, help="requests in part 1")
    ap.add_argument("--overhead-prompt-tokens", type=int, default=512, help="prompt length in part 1")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=128, help="tokens per stream request (restarted)")
    ap.add_argument("--prompts", type=int, default=6, help="long prompts arriving in part 2")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--rate", type=float, default=0.4, help="long-prompt arrivals per second")
    ap.add_argument("--itl-target-ms", type=int, default=50,
                    help="the stall-free colocated decode node's step target in part 2")
    ap.add_argument("--rounds", type=int, default=3, help="secure/insecure rounds in part 1, off/on rounds in part 3")
    ap.add_argument("--parts", default="overhead,mixed,tracing", help="which parts to run (comma-separated)")
    ap.add_argument("--pdmesh", default=BIN,
                    help="the pdmesh binary (e.g. another build's, to compare with the same script)")
    a = ap.parse_args()
    BIN = a.pdmesh
    parts = set(a.parts.split(","))
    report = {}

    if parts & {"overhead", "tls"}:
        # `tls` alone: only what security costs, without the engine-alone reference.
        overhead(a, report, engine="overhead" in parts)
    if "mixed" in parts:
        mixed_load(a, report)
    if "tracing" in parts:
        tracing(a, report)
    os.makedirs(".bench", exist_ok=True)
    with open(".bench/mesh.json", "w") as f:
        json.dump(report, f, indent=1)


def overhead(a, report, engine=True):
    n = a.overhead_prompt_tokens
    print(f"1. overhead: {n}-token prompts, 64 tokens out, {a.threads} thread(s) per engine, "
          f"{a.rounds} secure/insecure rounds", file=sys.stderr)
    common = ["--requests", str(a.requests), "--concurrency", "1", "--prompt-tokens", str(n), "--max-tokens", "64"]
    alone = bench(common + ["--engine-alone", "--model", a.model, "--threads", str(a.threads)]) if engine else None
    runs = {"secure": [], "insecure": []}
    for _ in range(a.rounds):
        for mode in ("secure", "insecure"):
            extra = ["--insecure"] if mode == "insecure" else []
            with Mesh(["--prefill", "1", "--decode", "1", "--threads", str(a.threads)] + extra, a.model) as m:
                bench(["--target", m.addr, "--requests", "1", "--prompt-tokens", "16", "--max-tokens", "4"], m.env)  # warm-up
                runs[mode].append(bench(common + ["--target", m.addr], m.env)["results"])
    report["overhead"] = {"engine_alone": alone, "mesh": runs}
    med = lambda mode, k: statistics.median(r[k]["p50"] for r in runs[mode])
    ts, ti = med("secure", "ttft_ms"), med("insecure", "ttft_ms")
    ls, li = med("secure", "itl_ms"), med("insecure", "itl_ms")
    print("\n== overhead (medians) ==")
    if alone:
        ar = alone["results"]
        print(f"TTFT {n}-token prompt: engine {ar['ttft_ms']['p50']:.1f} ms, mesh {ts:.1f} ms, "
              f"ratio {ts / ar['ttft_ms']['p50']:.3f} (goal <= 1.15)")
        print(f"inter-token latency: engine {ar['itl_ms']['p50']:.2f} ms, mesh {ls:.2f} ms, "
              f"difference {ls - ar['itl_ms']['p50']:+.2f} ms (goal <= +1 ms)")
    print(f"security (mTLS + API keys) vs --insecure: TTFT {ts:.1f} vs {ti:.1f} ms, ratio {ts / ti:.3f} "
          f"(goal <= 1.02); inter-token {ls:.2f} vs {li:.2f} ms, difference {ls - li:+.2f} ms (goal <= +0.2 ms)")


def mixed_load(a, report):
    print(f"2. mixed load: {a.streams} streams x {a.stream_tokens} tokens + {a.prompts} prompts of "
          f"{a.prompt_tokens} tokens at {a.rate}/s", file=sys.stderr)
    mixed = ["--streams", str(a.streams), "--stream-tokens", str(a.stream_tokens), "--requests", str(a.prompts),
             "--rate", str(a.rate), "--prompt-tokens", str(a.prompt_tokens), "--max-tokens", "16"]
    with Mesh(["--prefill", "1", "--decode", "1", "--threads", "1", "--prefill-cpus", "0", "--decode-cpus", "1"],
              a.model) as m:
        disagg = bench(mixed + ["--target", m.addr])
    # The colocated baseline is the stall-free one a user would run (prompt chunks sized to
    # the decode node's --itl-target-ms, 50 by default); the unpaced one (whole 512-token
    # chunks beside the streams) is shown for reference.
    coloc = {}
    for name, target in (("colocated", a.itl_target_ms), ("colocated unpaced", 0)):
        env = {"PDMESH_DECODE_ITL_TARGET_MS": str(target)}
        with Mesh(["--prefill", "0", "--decode", "1", "--threads", "2"], a.model, env) as m:
            coloc[name] = bench(mixed + ["--target", m.addr])
    report["mixed"] = {"disaggregated": disagg, **coloc, "itl_target_ms": a.itl_target_ms}
    print("\n== mixed load: 1 prefill + 1 decode pinned to a core each vs one colocated engine on both "
          f"(stall-free: --itl-target-ms {a.itl_target_ms}) ==")
    print(f"{'':18} {'stream ITL p50':>15} {'stream ITL p99':>15} {'prompt TTFT p50':>16} {'prompt TTFT p99':>16} {'total tok/s':>12}")
    for name, r in (("disaggregated", disagg), *coloc.items()):
        s, q = r["streams"], r["results"]
        print(f"{name:18} {s['itl_ms']['p50']:>15.1f} {s['itl_ms']['p99']:>15.1f} {q['ttft_ms']['p50']:>16.1f} "
              f"{q['ttft_ms']['p99']:>16.1f} {r['total_output_tok_s']:>12.1f}")
    d, c = disagg, coloc["colocated"]
    print(f"p99 ITL ratio colocated/disaggregated: {c['streams']['itl_ms']['p99'] / d['streams']['itl_ms']['p99']:.2f}; "
          f"throughput ratio disaggregated/colocated: {d['total_output_tok_s'] / c['total_output_tok_s']:.2f}")


class Collector:
    """`pdmesh collect` on a free port, counting the spans it receives."""

    def __enter__(self):
        self.p = subprocess.Popen([BIN, "collect", "--listen", "127.0.0.1:0", "--quiet", "--exit-with-stdin"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        if "listening on" not in line:
            self.p.kill()
            raise SystemExit(f"collector did not start: {line!r}")
        self.endpoint = "http://" + line.rsplit(" ", 1)[1].strip()
        return self

    def __exit__(self, *exc):
        self.p.stdin.close()
        err = self.p.stderr.read()
        self.p.wait(timeout=30)
        self.spans = int(err.split("collect: ")[1].split()[0]) if "collect: " in err else 0


def tracing(a, report):
    load = ["--requests", "24", "--concurrency", "4", "--prompt-tokens", "256", "--max-tokens", "32"]
    print(f"3. tracing off vs on (all spans exported): {' '.join(load)}, {a.rounds} rounds", file=sys.stderr)
    mesh = ["--prefill", "1", "--decode", "1", "--threads", "1"]
    runs = {"off": [], "on": []}
    spans = 0
    for _ in range(a.rounds):
        with Mesh(mesh, a.model) as m:
            bench(["--target", m.addr, "--requests", "1", "--prompt-tokens", "16", "--max-tokens", "4"])
            runs["off"].append(bench(load + ["--target", m.addr]))
        with Collector() as c:
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": c.endpoint, "OTEL_TRACES_SAMPLER": "always_on"}
            with Mesh(mesh, a.model, env) as m:
                bench(["--target", m.addr, "--requests", "1", "--prompt-tokens", "16", "--max-tokens", "4"])
                runs["on"].append(bench(load + ["--target", m.addr]))
        spans += c.spans
    report["tracing"] = {**runs, "spans_exported": spans}
    if spans == 0:
        raise SystemExit("tracing on exported no spans: the comparison would be meaningless")

    def med(mode, *path):
        vals = []
        for r in runs[mode]:
            v = r["results"]
            for k in path:
                v = v[k]
            vals.append(v)
        return statistics.median(vals)

    print(f"\n== tracing off vs on ({a.rounds} rounds each, medians; {spans} spans exported) ==")
    print(f"{'':22} {'off':>10} {'on':>10} {'on/off':>8}")
    for name, path in (("requests/s", ("req_s",)), ("output tokens/s", ("output_tok_s",)),
                       ("TTFT p50 ms", ("ttft_ms", "p50")), ("ITL p50 ms", ("itl_ms", "p50")),
                       ("e2e p50 ms", ("e2e_ms", "p50"))):
        off, on = med("off", *path), med("on", *path)
        print(f"{name:22} {off:>10.2f} {on:>10.2f} {on / off:>8.3f}")


if __name__ == "__main__":
    main()
