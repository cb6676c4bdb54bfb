#!/usr/bin/env python3
"""The real router and planner at scale, driven by simulated nodes (`--engine sim`: each step
takes the time the real engine takes by the calibration of `pdmesh bench engine --json`, tokens
are deterministic, KV still moves between nodes over gRPC at a few bytes a token). All of it on
this machine: one router process, one process hosting the prefill nodes, one the decode nodes,
and the load generator.

Part `scale`: for each node count (half prefill, half decode) and each offered rate, Poisson
arrivals of short requests for --seconds. Reports the rate served, the router's CPU per request
(its /proc ticks over the requests that ended), the router's own time per request (admission
to its prefill leaving the router: `pdmesh_router_dispatch_seconds`, p50/p99 from the
histogram's buckets), TTFT, failures, and how evenly requests fell on nodes.

Part `day`: the Mooncake conversation trace made into a day (`pdmesh replay --day`: its hour 24
times, thinned along a daily curve) and compressed in time, against a fixed fleet. Every
--every seconds the planner's desired pools (`pdmesh_planner_desired_nodes`) are read and set
against what the load needs: prompt tokens computed a second over a node's calibrated prefill
rate, output tokens a second over a node's decode rate at the ITL SLO, each at the planner's
target utilization, from the schedule the replay actually sent. A conversation's next turn
waits for the previous turn's answer (time compressed 240 times would otherwise send it before
that answer exists); the hit rate is given against the trace's ideal (an unbounded cache, no
time) and against what was reachable (blocks computed somewhere before the request came).

Both parts run --routers routers (default 2) in front of the same nodes: every node reports to
each router, and the load generator sends consecutive requests to different routers, as a load
balancer would. Each row also gives the routers' KV index staleness (the age of a block event
when a router applied it: `pdmesh_router_index_staleness_seconds`, p50/p99).

`--reference DIR/pdmesh` runs the same parts first with another build's router and nodes (the
load generator is this build's either way) and prints each number beside this build's, so a
before/after comes from one command on one machine.

Writes the raw numbers to .bench/sim.json.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

BIN = "target/release/pdmesh"  # the load generator, and the mesh unless --reference
PROFILE = "services/engine/src/sim_profile.json"
TRACE = "../shared/traces/conversation_trace.jsonl"


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


HZ = os.sysconf("SC_CLK_TCK")


def children_cpu():
    """CPU seconds of the finished child processes (the load generators)."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def scrape(url):
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def metric(text, name, labels=""):
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def by_role(text, name, role):
    """A gauge's value for `role`, summed over every model the router serves."""
    pat = rf'^{re.escape(name)}{{[^}}]*role="{role}"[^}}]*}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pat, text, re.M))


def nodes(text, role):
    """The router's usable nodes of `role`, over every model it serves."""
    return by_role(text, "pdmesh_router_nodes", role)


def buckets(text, name):
    """Cumulative bucket counts of a histogram, by upper bound."""
    out = []
    for m in re.finditer(rf'^{re.escape(name)}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M):
        le = float("inf") if m.group(1) == "+Inf" else float(m.group(1))
        out.append((le, float(m.group(2))))
    return sorted(out)


def merged(texts, name):
    """A histogram's buckets summed over several processes' scrapes."""
    out = {}
    for t in texts:
        for le, c in buckets(t, name):
            out[le] = out.get(le, 0.0) + c
    return sorted(out.items())


def quantile(before, after, q):
    """The q-quantile of what a histogram recorded between two scrapes, interpolated within
    its bucket."""
    b = dict(before)
    delta = [(le, c - b.get(le, 0.0)) for le, c in after]
    total = delta[-1][1] if delta else 0
    if total <= 0:
        return float("nan")
    want, lo, prev = q * total, 0.0, 0.0
    for le, c in delta:
        if c >= want:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (want - prev) / max(c - prev, 1e-9)
        lo, prev = le, c
    return lo


class Mesh:
    """Routers in front of two fleets of simulated nodes that report to every router."""

    def __init__(self, a, bin, prefill, decode, router_flags=()):
        router_flags = [*router_flags, *a.router_flags.split()]
        env = dict(os.environ, PDMESH_LOG="warn")
        self.procs, self.routers, self.apis, self.metrics, internals = [], [], [], [], []
        for _ in range(a.routers):
            api, internal, mport = (f"127.0.0.1:{port()}" for _ in range(3))
            self.routers.append(subprocess.Popen(
                [bin, "router", "--insecure", "--allow-anonymous", "--listen", api,
                 "--internal-listen", internal, "--metrics-listen", mport, "--model", a.model,
                 "--max-in-flight", str(a.max_in_flight), *router_flags],
                stdout=subprocess.DEVNULL, env=env))
            self.apis.append(api)
            self.metrics.append(f"http://{mport}/metrics")
            internals.append(internal)
        self.procs.extend(self.routers)
        self.api = ",".join(self.apis)
        time.sleep(1.0)
        every = [f for i in internals for f in ("--router", i)]
        for role, n in (("prefill", prefill), ("decode", decode)):
            self.procs.append(subprocess.Popen(
                [bin, role, "--insecure", "--engine", "sim", "--sim-nodes", str(n),
                 "--listen", "127.0.0.1:0", *every, "--model", a.model,
                 "--kv-transport", "grpc", "--kv-blocks", str(a.kv_blocks),
                 "--max-running", str(a.max_running)],
                stdout=subprocess.DEVNULL, stdin=subprocess.PIPE, env=env))
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                ts = self.scrapes()
                if all(nodes(t, "prefill") == prefill and nodes(t, "decode") == decode
                       for t in ts):
                    return
            except OSError:
                pass
            for x in self.procs:
                if x.poll() is not None:
                    self.close()
                    raise SystemExit(f"a mesh process exited with {x.returncode}")
            time.sleep(1.0)
        self.close()
        raise SystemExit(f"{prefill}+{decode} nodes did not all register with every router"
                         " in 180 s")

    def scrapes(self):
        return [scrape(m) for m in self.metrics]

    def router_ticks(self):
        return sum(ticks(r.pid) for r in self.routers)

    def node_ticks(self):
        return sum(ticks(p.pid) for p in self.procs if p not in self.routers)

    def close(self):
        # Nodes first: a router gone before them only makes them log their retries.
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def tools(args, timeout):
    out = subprocess.run([BIN, *args, "--insecure", "--json"], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{args[0]} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


DISPATCH = "pdmesh_router_dispatch_seconds"
STALENESS = "pdmesh_router_index_staleness_seconds"


def staleness_ms(before, after):
    """p50/p99 of the block events the routers applied between two sets of scrapes (None
    where the routers keep no such index)."""
    b1 = merged(after, STALENESS)
    if not b1:
        return {"p50": None, "p99": None, "events": 0}
    b0 = merged(before, STALENESS)
    n = b1[-1][1] - dict(b0).get(float("inf"), 0.0)
    return {"p50": 1e3 * quantile(b0, b1, 0.5), "p99": 1e3 * quantile(b0, b1, 0.99),
            "events": int(n)}


def ms(v, digits=1):
    return "-" if v is None or v != v else f"{v:.{digits}f}"


def scale(a, bin):
    rows = []
    for nodes in a.nodes:
        mesh = Mesh(a, bin, nodes // 2, nodes - nodes // 2)
        try:
            # What the routers spend with no requests: load reports, the planner, scrapes.
            i0, w0 = mesh.router_ticks(), time.time()
            time.sleep(5)
            idle = (mesh.router_ticks() - i0) / HZ / (time.time() - w0)
            print(f"{nodes:>5} nodes idle: routers {idle:.3f} cores", flush=True)
            for rate in a.rates:
                s0 = mesh.scrapes()
                t0 = mesh.router_ticks()
                nodes0 = mesh.node_ticks()
                client0 = children_cpu()
                n = int(rate * a.seconds)
                r = tools(["bench", "--target", mesh.api, "--rate", str(rate), "--requests",
                           str(n), "--prompt-tokens", str(a.prompt_tokens), "--max-tokens",
                           str(a.max_tokens)], timeout=a.seconds * 20 + 300)
                cpu = (mesh.router_ticks() - t0) / HZ
                node_cpu = (mesh.node_ticks() - nodes0) / HZ
                client_cpu = children_cpu() - client0
                s1 = mesh.scrapes()
                b0, b1 = merged(s0, DISPATCH), merged(s1, DISPATCH)
                res = r["results"]
                row = {
                    "nodes": nodes, "routers": a.routers, "offered_req_s": rate, "requests": n,
                    "ok": res["ok"], "failed": res["failed"], "errors": res["errors"],
                    "served_req_s": res["req_s"], "wall_s": r["wall_s"],
                    # All routers together: each request passes through one of them.
                    "router_cpu_ms_per_req": 1e3 * cpu / max(n, 1),
                    "router_cores": cpu / r["wall_s"],
                    "router_idle_cores": idle,
                    # The requests' own share: the row's CPU less what idling that long costs.
                    "router_cpu_ms_per_req_over_idle":
                        1e3 * max(cpu - idle * r["wall_s"], 0.0) / max(n, 1),
                    "nodes_cpu_ms_per_req": 1e3 * node_cpu / max(n, 1),
                    "client_cpu_ms_per_req": 1e3 * client_cpu / max(n, 1),
                    "dispatch_ms_p50": 1e3 * quantile(b0, b1, 0.5),
                    "dispatch_ms_p99": 1e3 * quantile(b0, b1, 0.99),
                    "staleness_ms": staleness_ms(s0, s1),
                    "ttft_ms": res["ttft_ms"], "placement": res["placement"],
                }
                rows.append(row)
                st = row["staleness_ms"]
                print(f"{nodes:>5} nodes {rate:>6} req/s offered: served {row['served_req_s']:7.1f}"
                      f" req/s, {row['failed']} failed; routers {row['router_cpu_ms_per_req']:.3f}"
                      f" ({row['router_cpu_ms_per_req_over_idle']:.3f} over idle)"
                      f" ms CPU/req ({row['router_cores']:.2f} cores), nodes"
                      f" {row['nodes_cpu_ms_per_req']:.3f}, client {row['client_cpu_ms_per_req']:.3f};"
                      f" dispatch p50"
                      f" {row['dispatch_ms_p50']:.2f} p99 {row['dispatch_ms_p99']:.2f} ms; TTFT"
                      f" p50 {res['ttft_ms']['p50']:.0f} p99 {res['ttft_ms']['p99']:.0f} ms;"
                      f" decode nodes used {res['placement']['decode']['nodes_used']}, busiest"
                      f" {res['placement']['decode']['max_over_mean']:.2f}x the mean;"
                      f" index staleness p50 {ms(st['p50'])} p99 {ms(st['p99'])} ms",
                      flush=True)
        finally:
            mesh.close()
    return rows


def capacity(profile, itl_slo_ms):
    """A node's calibrated prefill tokens/s, and decode tokens/s at the largest batch whose step
    stays within the ITL SLO (linear between measured batch sizes, as the sim steps)."""
    p = json.load(open(profile))
    pts = sorted([(1, 1.0 / p["decode_tok_s"])] +
                 [(int(b), int(b) / r) for b, r in p["batched_decode_tok_s"].items()])
    pts = sorted(dict(pts).items())
    slo, best = itl_slo_ms / 1e3, 0.0
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        for b in range(b0, b1 + 1):
            s = s0 + (s1 - s0) * (b - b0) / (b1 - b0)
            if s <= slo:
                best = max(best, b / s)
    if pts[-1][1] <= slo:  # past the last point, along its slope
        (b0, s0), (b1, s1) = pts[-2], pts[-1]
        slope = (s1 - s0) / (b1 - b0)
        b = b1 + int((slo - s1) / slope) if slope > 0 else b1
        best = max(best, b / (s1 + slope * (b - b1)))
    return p["prefill_tok_s"], best


def day(a, bin):
    prefill_tps, decode_tps = capacity(PROFILE, a.itl_slo_ms)
    flags = ["--planner-window-s", str(a.window_s), "--planner-cooldown-s", str(a.cooldown_s),
             "--max-prefill", str(a.day_prefill * 4), "--max-decode", str(a.day_decode * 4),
             "--itl-slo-ms", str(a.itl_slo_ms)]
    mesh = Mesh(a, bin, a.day_prefill, a.day_decode, flags)
    schedule = ".bench/sim-day-schedule.jsonl"
    samples = []
    try:
        s0 = mesh.scrapes()
        replay = subprocess.Popen(
            [BIN, "replay", "--insecure", "--json", "--target", mesh.api, "--trace", a.trace,
             "--day", "--keep", str(a.keep), "--time-scale", str(a.time_scale),
             "--token-scale", str(a.token_scale), "--schedule", schedule],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        t0 = time.time()
        while replay.poll() is None:
            time.sleep(a.every)
            try:
                ts = mesh.scrapes()
            except OSError:
                continue
            # Each router plans for the requests it served: the pools need their sum (what an
            # autoscaler summing the gauge over the routers would ask for).
            g = lambda n, r: sum(by_role(t, n, r) for t in ts)
            samples.append({
                "t": time.time() - t0,
                "desired": {r: g("pdmesh_planner_desired_nodes", r) for r in ("prefill", "decode")},
                "needed": {r: g("pdmesh_planner_needed_nodes", r) for r in ("prefill", "decode")},
            })
        report = json.loads(replay.stdout.read().strip().splitlines()[-1])
        staleness = staleness_ms(s0, mesh.scrapes())
    finally:
        mesh.close()
    sent = [json.loads(l) for l in open(schedule)]
    hit = report["hit_rate"]
    util = 0.7
    rows = []
    for s in samples:
        lo = s["t"] - a.window_s
        w = [r for r in sent if lo < r["at_s"] <= s["t"]]
        prompt = sum(r["prompt"] for r in w) * (1 - hit) / a.window_s
        out = sum(r["output"] for r in w) / a.window_s
        need = {"prefill": -(-prompt // (prefill_tps * util)), "decode": -(-out // (decode_tps * util))}
        rows.append({**s, "load_needs": need, "prompt_tok_s": prompt, "output_tok_s": out})
    return {"report": report, "timeline": rows, "prefill_tok_s_per_node": prefill_tps,
            "decode_tok_s_per_node_at_slo": decode_tps, "staleness_ms": staleness}


def print_day(d, minutes_per_row):
    print(f"\nday: {d['report']['requests']} requests, hit rate {d['report']['hit_rate']:.3f}"
          f" of an ideal {d['report']['ideal_hit_rate']:.3f} (reachable"
          f" {d['report'].get('reachable_hit_rate', float('nan')):.3f}: computed before the"
          f" request came); node capacity: prefill"
          f" {d['prefill_tok_s_per_node']:.0f} tok/s, decode {d['decode_tok_s_per_node_at_slo']:.0f}"
          f" tok/s at the ITL SLO")
    r = d["report"]["results"]
    st = d["staleness_ms"]
    print(f"  {r['ok']} ok, {r['failed']} failed; TTFT p50 {r['ttft_ms']['p50']:.0f} p99"
          f" {r['ttft_ms']['p99']:.0f} ms; TPOT p50 {r['tpot_ms']['p50']:.1f} ms; SLO attained"
          f" {100 * r['slo_attainment']:.0f}%; index staleness p50 {ms(st['p50'])} p99"
          f" {ms(st['p99'])} ms over {st['events']} events")
    print("  t(s)  prompt tok/s  out tok/s   prefill: planner/needs   decode: planner/needs")
    last = -1e9
    for row in d["timeline"]:
        if row["t"] - last < minutes_per_row:
            continue
        last = row["t"]
        dz, nd = row["desired"], row["load_needs"]
        print(f"  {row['t']:5.0f} {row['prompt_tok_s']:12.0f} {row['output_tok_s']:10.0f}"
              f"   {dz['prefill'] or 0:>8.0f} / {nd['prefill']:<8.0f}"
              f"   {dz['decode'] or 0:>8.0f} / {nd['decode']:<8.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--parts", default="scale,day")
    ap.add_argument("--nodes", default="100,1000", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--rates", default="200,1000,2000,5000,10000",
                    type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--seconds", type=float, default=10.0, help="each scale row's arrivals")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=20000, help="each simulated node's pool")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--max-in-flight", type=int, default=20000)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--keep", type=float, default=0.05, help="share of the day's requests sent")
    ap.add_argument("--time-scale", type=float, default=1 / 240)
    ap.add_argument("--token-scale", type=float, default=1 / 16)
    ap.add_argument("--day-prefill", type=int, default=100)
    ap.add_argument("--day-decode", type=int, default=20)
    ap.add_argument("--window-s", type=int, default=10)
    ap.add_argument("--cooldown-s", type=int, default=10)
    ap.add_argument("--itl-slo-ms", type=float, default=100.0)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between planner reads")
    ap.add_argument("--routers", type=int, default=2, help="routers sharing the nodes")
    ap.add_argument("--router-flags", default="", metavar="FLAGS",
                    help="more flags for every router, e.g. \"--prefix-max-imbalance 4\"")
    ap.add_argument("--reference", metavar="BIN",
                    help="another build's pdmesh: its routers and nodes run the same parts first")
    a = ap.parse_args()
    if a.routers < 1:
        ap.error("--routers must be at least 1")
    os.makedirs(".bench", exist_ok=True)
    out = {"args": {k: v for k, v in vars(a).items()}}
    parts = a.parts.split(",")
    runs = ([("reference", a.reference)] if a.reference else []) + [("this build", BIN)]
    for label, bin in runs:
        print(f"\n== {label}: {bin}, {a.routers} router(s)", flush=True)
        run = {}
        if "scale" in parts:
            run["scale"] = scale(a, bin)
        if "day" in parts:
            run["day"] = day(a, bin)
            print_day(run["day"], 20)
        out[label] = run
    if a.reference:
        compare(out["reference"], out["this build"])
    with open(".bench/sim.json", "w") as f:
        json.dump(out, f, indent=1)
    print("\nraw numbers: .bench/sim.json")


def compare(ref, new):
    """Each headline number of the reference beside this build's."""
    print("\n== reference -> this build")
    for r0, r1 in zip(ref.get("scale", []), new.get("scale", [])):
        dec = lambda r: r["placement"]["decode"]
        print(f"  {r1['nodes']:>5} nodes {r1['offered_req_s']:>6} req/s: router CPU/req"
              f" {1e3 * r0['router_cpu_ms_per_req']:.0f} -> {1e3 * r1['router_cpu_ms_per_req']:.0f}"
              f" us ({r1['router_cpu_ms_per_req'] / r0['router_cpu_ms_per_req']:.2f}x);"
              f" dispatch p99 {r0['dispatch_ms_p99']:.2f} -> {r1['dispatch_ms_p99']:.2f} ms;"
              f" busiest decode {dec(r0)['max_over_mean']:.2f} -> {dec(r1)['max_over_mean']:.2f}x"
              f" the mean ({dec(r0)['nodes_used']} -> {dec(r1)['nodes_used']} nodes used);"
              f" failed {r0['failed']} -> {r1['failed']}")
    if "day" in ref and "day" in new:
        h = lambda d: d["report"]["hit_rate"] / max(d["report"]["ideal_hit_rate"], 1e-9)
        hr = lambda d: d["report"]["hit_rate"] / max(d["report"].get("reachable_hit_rate", 0), 1e-9)
        print(f"  day: hit rate {100 * h(ref['day']):.0f}% -> {100 * h(new['day']):.0f}% of ideal,"
              f" {100 * hr(ref['day']):.0f}% -> {100 * hr(new['day']):.0f}% of reachable;"
              f" TTFT p50 {ref['day']['report']['results']['ttft_ms']['p50']:.0f} ->"
              f" {new['day']['report']['results']['ttft_ms']['p50']:.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
