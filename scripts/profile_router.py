#!/usr/bin/env python3
"""Where a router's CPU goes per request: the simulated fleet of `bench_sim.py` (real routers,
sim nodes, 2 routers sharing them), a burst of short requests, and `perf record` on the first
router meanwhile. Each sample is charged to the innermost frame that says what it is for:

- rpc stack: h2, hyper, tonic, tower, prost and the socket wrappers (the gRPC calls themselves:
  the client's Generate and the router's Reserve, Prefill and Decode to the nodes, and the
  nodes' report streams);
- router logic: pdmesh_router and the crates it calls directly (placement, the index,
  attempts, the relay), with the allocations they make;
- tokio scheduler: task wake-ups and parking;
- tracing: spans and their export.

Prints each share and its microseconds per request (the router's /proc ticks over the burst,
divided by the requests). Needs `perf` (Debian: linux-perf) and permission to attach to a
process (root, or kernel.perf_event_paranoid <= 1).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sim  # noqa: E402

RPC = ("h2::", "hyper", "tonic", "tower", "prost", "http_body", "tokio::net", "mio::",
       "pdmesh_common::gate", "pdmesh_common::trace::TraceService", "pdmesh_common::authz")
LOGIC = ("pdmesh_router", "pdmesh_kv_types", "pdmesh_wire", "pdmesh_common")
TRACING = ("tracing", "opentelemetry")


def classify(frames):
    """The category of one sample, from its frames innermost first."""
    for f in frames:
        if any(k in f for k in RPC):
            return "rpc stack"
        if any(k in f for k in LOGIC):
            return "router logic"
        if any(k in f for k in TRACING):
            return "tracing"
        if "tokio::runtime" in f:
            return "tokio scheduler"
    return "kernel and unresolved"


def shares(perf_data):
    out = subprocess.run(["perf", "script", "-i", perf_data], capture_output=True, text=True,
                         check=True).stdout
    count = collections.Counter()
    for sample in out.split("\n\n"):
        lines = [line.strip() for line in sample.strip().split("\n")[1:]]
        if lines:
            count[classify([re.sub(r"^[0-9a-f]+ ", "", line) for line in lines])] += 1
    return count


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=bench_sim.BIN, help="the pdmesh binary to profile")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--nodes", type=int, default=100, help="half prefill, half decode")
    ap.add_argument("--rate", type=float, default=1000.0, help="offered requests a second")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--routers", type=int, default=2)
    a = ap.parse_args()
    if a.nodes < 2 or a.rate <= 0 or a.seconds <= 0:
        ap.error("--nodes must be at least 2, --rate and --seconds positive")
    mesh_args = argparse.Namespace(model=a.model, routers=a.routers, router_flags="",
                                   kv_blocks=20000, max_running=64, max_in_flight=20000)
    mesh = bench_sim.Mesh(mesh_args, a.bin, a.nodes // 2, a.nodes - a.nodes // 2)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        try:
            # As bench_sim's scale rows: the joins' first reports and channels settle first.
            time.sleep(5)
            router = mesh.routers[0].pid
            perf = subprocess.Popen(["perf", "record", "-F", "999", "--call-graph",
                                     "dwarf,16384", "-o", data, "-p", str(router)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
            t0 = bench_sim.ticks(router)
            n = int(a.rate * a.seconds)
            r = bench_sim.tools(["bench", "--target", mesh.api, "--rate", str(a.rate),
                                 "--requests", str(n), "--prompt-tokens", "16",
                                 "--max-tokens", "4"], timeout=a.seconds * 20 + 300)
            cpu = (bench_sim.ticks(router) - t0) / bench_sim.HZ
            perf.send_signal(2)
            perf.wait()
        finally:
            mesh.close()
        if perf.returncode not in (0, -2):
            raise SystemExit(f"perf record failed ({perf.returncode}): is perf installed and"
                             " allowed to attach?")
        count = shares(data)
    total = sum(count.values())
    if total == 0:
        raise SystemExit("perf recorded no samples")
    # The load generator alternates routers: the first one served about 1/routers of them.
    per_req = 1e6 * cpu / max(n / a.routers, 1)
    res = r["results"]
    print(f"{a.nodes} nodes, {res['req_s']:.0f} req/s served of {a.rate:.0f} offered"
          f" ({res['ok']} ok, {res['failed']} failed, TTFT p50 {res['ttft_ms']['p50']:.0f} ms);"
          f" router 0: {per_req:.0f} us CPU per request, {total} samples")
    for k, v in count.most_common():
        print(f"  {100 * v / total:5.1f}%  {per_req * v / total:6.0f} us  {k}")


if __name__ == "__main__":
    main()
