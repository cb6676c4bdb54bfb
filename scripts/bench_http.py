#!/usr/bin/env python3
"""The OpenAI HTTP frontend against the gRPC one, on the same router in the same run
(`pdmesh bench` vs `pdmesh bench --http`: the same requests, streamed, over HTTP/2 either way).

Part `overhead`: a router and simulated nodes (`--engine sim`: every step takes the real
engine's calibrated time, so the nodes add no noise of their own), one request at a time;
rounds alternate the frontends. Reports TTFT and ITL p50 per frontend, the medians over
rounds, and HTTP minus gRPC.

Part `ceiling`: the same with many simulated nodes and a trivially small completion (a 4-token
prompt, 1 token out), closed-loop at high concurrency: the requests a second one router
sustains on each frontend, and the router's CPU per request (its /proc ticks).

Part `real`: `pdmesh up` on the real model (TLS, API keys; prefix cache off so every prompt is
computed), alternating rounds: TTFT and ITL on each frontend as a user sees them.

Writes the raw numbers to .bench/http.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_sim import BIN, HZ, Mesh, port, ticks  # noqa: E402  (the sim mesh, /proc)


def bench(target, http, args, insecure=True, timeout=900):
    cmd = [BIN, "bench", "--target", target, "--json", *args]
    if http:
        cmd += ["--http", http]
    if insecure:
        cmd.append("--insecure")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"bench failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rounds(a, target, http, load, insecure):
    """Alternating rounds of `load` on each frontend; each run its own prompts (seed)."""
    runs = {"grpc": [], "http": []}
    for r in range(a.rounds):
        for fe in ("grpc", "http"):
            seed = 1000 * r + (1 if fe == "http" else 0) + a.seed
            res = bench(target, http if fe == "http" else None, [*load, "--seed", str(seed)],
                        insecure)["results"]
            if res["failed"]:
                raise SystemExit(f"{fe}: {res['failed']} failed: {res['errors']}")
            runs[fe].append({"ttft_p50": res["ttft_ms"]["p50"], "itl_p50": res["itl_ms"]["p50"],
                             "ttft_p90": res["ttft_ms"]["p90"], "itl_p90": res["itl_ms"]["p90"],
                             "req_s": res["req_s"]})
            print(f"  round {r + 1} {fe:>4}: TTFT p50 {runs[fe][-1]['ttft_p50']:.2f} ms, "
                  f"ITL p50 {runs[fe][-1]['itl_p50']:.3f} ms", flush=True)
    med = {fe: {k: statistics.median(x[k] for x in v) for k in v[0]} for fe, v in runs.items()}
    delta = {k: med["http"][k] - med["grpc"][k] for k in ("ttft_p50", "itl_p50")}
    print(f"  medians: gRPC TTFT {med['grpc']['ttft_p50']:.2f} ITL {med['grpc']['itl_p50']:.3f};"
          f" HTTP TTFT {med['http']['ttft_p50']:.2f} ITL {med['http']['itl_p50']:.3f} ms;"
          f" HTTP - gRPC: TTFT {delta['ttft_p50']:+.2f} ms, ITL {delta['itl_p50']:+.3f} ms",
          flush=True)
    return {"runs": runs, "median": med, "http_minus_grpc_ms": delta}


def sim_mesh(a, nodes):
    http = f"127.0.0.1:{port()}"
    mesh = Mesh(a, nodes, nodes, router_flags=("--http-listen", http))
    return mesh, http


def overhead(a):
    print("overhead: 1+1 simulated nodes, one request at a time", flush=True)
    mesh, http = sim_mesh(a, 1)
    try:
        load = ["--requests", str(a.requests), "--concurrency", "1", "--prompt-tokens", "64",
                "--max-tokens", "32"]
        return rounds(a, mesh.api, http, load, True)
    finally:
        mesh.close()


def ceiling(a):
    print(f"ceiling: {a.ceiling_nodes}+{a.ceiling_nodes} simulated nodes, 4-token prompts, "
          f"1 token out, {a.ceiling_concurrency} in flight", flush=True)
    mesh, http = sim_mesh(a, a.ceiling_nodes)
    out = {}
    try:
        for r in range(a.rounds):
            for fe in ("grpc", "http"):
                t0 = ticks(mesh.router.pid)
                res = bench(mesh.api, http if fe == "http" else None,
                            ["--requests", str(a.ceiling_requests), "--concurrency",
                             str(a.ceiling_concurrency), "--prompt-tokens", "4", "--max-tokens",
                             "1", "--seed", str(r)])
                cpu = (ticks(mesh.router.pid) - t0) / HZ
                n = res["results"]["ok"]
                row = {"req_s": res["results"]["req_s"], "failed": res["results"]["failed"],
                       "router_cpu_ms_per_req": 1e3 * cpu / max(n, 1),
                       "router_cores": cpu / res["wall_s"]}
                out.setdefault(fe, []).append(row)
                print(f"  round {r + 1} {fe:>4}: {row['req_s']:.0f} req/s, {row['failed']} failed,"
                      f" router {row['router_cpu_ms_per_req']:.3f} ms CPU/req"
                      f" ({row['router_cores']:.2f} cores)", flush=True)
    finally:
        mesh.close()
    med = {fe: {k: statistics.median(x[k] for x in v) for k in ("req_s", "router_cpu_ms_per_req")}
           for fe, v in out.items()}
    print(f"  medians: gRPC {med['grpc']['req_s']:.0f} req/s "
          f"({med['grpc']['router_cpu_ms_per_req']:.3f} ms CPU/req); HTTP {med['http']['req_s']:.0f}"
          f" req/s ({med['http']['router_cpu_ms_per_req']:.3f} ms CPU/req); HTTP/gRPC "
          f"{med['http']['req_s'] / med['grpc']['req_s']:.2f}x", flush=True)
    return {"runs": out, "median": med}


def real(a):
    print("real: pdmesh up (1 prefill, 1 decode, TLS, no prefix cache)", flush=True)
    api, http = f"127.0.0.1:{port()}", f"127.0.0.1:{port()}"
    up = subprocess.Popen(
        [BIN, "up", "--model", a.model, "--listen", api, "--http-listen", http,
         "--kvstore-budget-bytes", "0", "--cache-bytes", "0"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PDMESH_LOG="warn"))
    try:
        for line in up.stdout:
            if "mesh ready" in line:
                break
        else:
            raise SystemExit("pdmesh up exited before the mesh was ready")
        load = ["--requests", str(a.real_requests), "--concurrency", "2", "--prompt-tokens",
                "128", "--max-tokens", "32"]
        return rounds(a, api, http, load, insecure=False)
    finally:
        up.terminate()
        up.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--parts", default="overhead,ceiling,real")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=100, help="overhead: requests per run")
    ap.add_argument("--ceiling-nodes", type=int, default=16, help="of each role")
    ap.add_argument("--ceiling-requests", type=int, default=3000)
    ap.add_argument("--ceiling-concurrency", type=int, default=64)
    ap.add_argument("--real-requests", type=int, default=24)
    # What bench_sim's Mesh reads.
    ap.add_argument("--kv-blocks", type=int, default=20000)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--max-in-flight", type=int, default=20000)
    a = ap.parse_args()
    parts = a.parts.split(",")
    report = {}
    for name, fn in (("overhead", overhead), ("ceiling", ceiling), ("real", real)):
        if name in parts:
            report[name] = fn(a)
    os.makedirs(".bench", exist_ok=True)
    with open(".bench/http.json", "w") as f:
        json.dump(report, f, indent=1)
    print("wrote .bench/http.json")


if __name__ == "__main__":
    main()
