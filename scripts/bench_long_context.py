#!/usr/bin/env python3
"""Long contexts, in one run.

1. Long prompts: TTFT and peak RSS of `pdmesh run` (one engine, this machine's cores) on the
   first N tokens of Verne's "Around the World in Eighty Days" (public domain), per model and
   length, each beside a 1,024-token run of the same model in the same command: TTFT per
   token against it (how far past linear the length goes) and RSS over it (what the KV and
   activations of the longer prompt add).

2. Prefix tiers: TTFT of a prompt whose --system-tokens long prefix is computed (cold), held
   by the KV-store in RAM, and held only on its disk (the KV-store killed with SIGKILL and
   restarted by `pdmesh up` between), through 1 prefill + 1 decode node whose own cache is
   off (`--cache-bytes 0`); then the same with the prefill node's own cache in RAM and on its
   disk tier (the prefill node killed instead). Medians over --reps prompts; ratios over the
   cold TTFT.

3. A window's KV: Gemma 3 270M on the first --window-tokens tokens (five of its six layers
   attend through a 512-token window) in a roomy pool, which reports the most blocks it held
   at once; then in exactly that many blocks, and in one fewer, which must run out. Beside
   what keeping every block of every layer takes (tokens / 16): TTFT and peak RSS of the
   first two.

Absolute times drift on a shared machine; compare within one run. Raw numbers go to
.bench/long_context.json.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_mesh import BIN, Mesh, bench  # noqa: E402

MODELS = {
    "smollm2": "models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "llama3-1b": "models/test/synth-llama3-1b-Q4_K_M.gguf",
    "gemma3": "models/gemma-3-270m-q4_k_m.gguf",
}


def verne(path):
    from verne import verne_path, verne_text
    with open(path, "w", encoding="utf-8") as f:
        f.write(verne_text(verne_path()))


def run_once(model, text, tokens, threads, blocks=None, step=512, refused=False, peak=False):
    """TTFT (ms) and peak RSS (MiB) of one `pdmesh run` of `tokens` prompt tokens (and with
    `peak`, the most KV blocks it held at once); with `refused`, checks that it is refused
    for want of KV blocks instead."""
    blocks = blocks or tokens // 16 + 64
    cmd = ["/usr/bin/time", "-v", BIN, "run", "--model", model, "--raw", "--prompt-file", text,
           "--prompt-tokens", str(tokens), "--max-tokens", "1", "--json", "--kv-blocks", str(blocks),
           "--threads", str(threads), "--max-batch-tokens", str(step)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if refused:
        if p.returncode == 0 or "exhausted" not in p.stderr:
            raise SystemExit(f"{' '.join(cmd)} was not refused for KV:\n{p.stderr[-2000:]}")
        return None
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    out = json.loads(p.stdout)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    if peak:
        return out["ttft_ms"], rss / 1024, out["kv_peak_blocks"]
    return out["ttft_ms"], rss / 1024


def long_prompts(a, report):
    text = os.path.join(tempfile.gettempdir(), "pdmesh-verne.txt")
    verne(text)
    rows = []
    for spec in a.long:
        name, n = spec.split(":")
        model, n = MODELS[name], int(n)
        if not os.path.exists(model):
            print(f"  skipped {name}: {model} is missing", file=sys.stderr)
            continue
        print(f"  {name}: 1,024 then {n:,} tokens ...", file=sys.stderr)
        ref_ttft, ref_rss = run_once(model, text, 1024, a.threads)
        ttft, rss = run_once(model, text, n, a.threads)
        rows.append({"model": name, "tokens": n, "ttft_ms": ttft, "rss_mib": rss,
                     "ref_ttft_ms": ref_ttft, "ref_rss_mib": ref_rss})
    report["long_prompts"] = rows
    threads = a.threads or os.cpu_count()
    print(f"\n== long prompts: one engine, {threads} threads ==")
    print(f"{'model':10} {'tokens':>7} {'TTFT s':>8} {'tok/s':>7} {'peak RSS MiB':>13} "
          f"{'per-token vs 1K':>16} {'RSS - 1K run':>13}")
    for r in rows:
        per = (r["ttft_ms"] / r["tokens"]) / (r["ref_ttft_ms"] / 1024)
        print(f"{r['model']:10} {r['tokens']:>7} {r['ttft_ms'] / 1e3:>8.1f} "
              f"{r['tokens'] / (r['ttft_ms'] / 1e3):>7.0f} {r['rss_mib']:>13.0f} "
              f"{per:>15.2f}x {r['rss_mib'] - r['ref_rss_mib']:>12.0f}M")


def window_kv(a, report):
    text = os.path.join(tempfile.gettempdir(), "pdmesh-verne.txt")
    verne(text)
    model, n, step, bs, window = MODELS["gemma3"], a.window_tokens, a.max_batch_tokens, 16, 512
    if not os.path.exists(model):
        print(f"  skipped: {model} is missing (just fetch-gemma3)", file=sys.stderr)
        return
    # Every block of every layer, as before local layers let go of what their window left.
    whole = -(-n // bs)
    print(f"  gemma3 {n:,} tokens in {whole + 64} blocks, then in its peak, then one fewer ...",
          file=sys.stderr)
    full_ttft, full_rss, least = run_once(model, text, n, a.threads, whole + 64, step, peak=True)
    ttft, rss = run_once(model, text, n, a.threads, least, step)
    run_once(model, text, n, a.threads, least - 1, step, refused=True)
    report["window_kv"] = {"tokens": n, "whole_blocks": whole, "least_blocks": least,
                           "roomy_ttft_ms": full_ttft, "roomy_rss_mib": full_rss,
                           "least_ttft_ms": ttft, "least_rss_mib": rss}
    print(f"\n== a window's KV: Gemma 3 270M, {n:,} tokens, steps of {step} ==")
    print(f"every block of every layer would take {whole} blocks of {bs} tokens")
    print(f"{'pool':28} {'blocks':>7} {'TTFT s':>8} {'peak RSS MiB':>13}")
    print(f"{'roomy (' + str(whole + 64) + ')':28} {whole + 64:>7} {full_ttft / 1e3:>8.1f} "
          f"{full_rss:>13.0f}")
    print(f"{'its peak':28} {least:>7} {ttft / 1e3:>8.1f} {rss:>13.0f}")
    print(f"{least - 1} blocks: refused. Peak {whole / least:.2f}x below every block; "
          f"TTFT {ttft / full_ttft:.3f}x, RSS {full_rss - rss:.0f} MiB less than roomy")


def children(pid):
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [(int(l.split()[0]), l) for l in out.splitlines() if l.strip()]


def kill_child(mesh, config_name):
    """SIGKILLs the mesh's child started on `config_name`, and waits until `up` has started
    another."""
    old = [p for p, args in children(mesh.p.pid) if f"/{config_name}" in args]
    if len(old) != 1:
        raise SystemExit(f"no single child on {config_name}: {children(mesh.p.pid)}")
    os.kill(old[0], signal.SIGKILL)
    deadline = time.time() + 60
    while time.time() < deadline:
        new = [p for p, args in children(mesh.p.pid) if f"/{config_name}" in args and p != old[0]]
        if new:
            # Serving again (and known to the router) takes a moment after the start.
            time.sleep(3)
            return
        time.sleep(0.2)
    raise SystemExit(f"{config_name} was not restarted")


def prefix_tiers(a, report):
    rows = {}
    common = ["--concurrency", "1", "--shared-prefix-tokens", str(a.system_tokens),
              "--prompt-tokens", "16", "--max-tokens", "2", "--requests", "1"]
    for tier, victim, extra in (
        ("KV-store", "kvstore.toml", ["--cache-bytes", "0", "--kvstore-disk-dir"]),
        ("prefill node's own", "prefill-0.toml", ["--cache-disk-dir"]),
    ):
        with tempfile.TemporaryDirectory() as disk:
            flags = ["--prefill", "1", "--decode", "1"] + extra + [disk]
            with Mesh(flags, a.model) as m:
                t = ["--target", m.addr]
                bench(t + ["--requests", "1", "--prompt-tokens", "16", "--max-tokens", "2"])
                one = lambda i, seed: bench(t + common + ["--prefix-seed", str(2000 + i), "--seed", str(seed)])["results"]
                cold = [one(i, 0) for i in range(a.reps)]
                ram = [one(i, 1) for i in range(a.reps)]
                kill_child(m, victim)
                if a.drop_caches:
                    # The files were just written: without this their reads come from the
                    # page cache, not the disk.
                    subprocess.run(["sync"], check=True)
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("3\n")
                disk_hits = [one(i, 2) for i in range(a.reps)]
            med = lambda rs, k: statistics.median(r[k]["p50"] for r in rs)
            rows[tier] = {
                "cold_ms": med(cold, "ttft_ms"), "ram_ms": med(ram, "ttft_ms"),
                "disk_ms": med(disk_hits, "ttft_ms"),
                "cached": [med(cold, "cached_tokens"), med(ram, "cached_tokens"),
                           med(disk_hits, "cached_tokens")],
            }
    report["prefix_tiers"] = rows
    print(f"\n== TTFT of a {a.system_tokens}-token cached prefix + 16-token question "
          f"(medians of {a.reps}) ==")
    print(f"{'cache':20} {'recompute ms':>13} {'RAM ms':>8} {'disk ms':>8} "
          f"{'cached tokens (cold/RAM/disk)':>30} {'recompute/RAM':>14} {'recompute/disk':>15}")
    for tier, r in rows.items():
        c = "/".join(str(int(x)) for x in r["cached"])
        print(f"{tier:20} {r['cold_ms']:>13.1f} {r['ram_ms']:>8.1f} {r['disk_ms']:>8.1f} {c:>30} "
              f"{r['cold_ms'] / r['ram_ms']:>13.2f}x {r['cold_ms'] / r['disk_ms']:>14.2f}x")


def main():
    global BIN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODELS["smollm2"], help="the model of part 2")
    ap.add_argument("--long", nargs="*",
                    default=["smollm2:8000", "llama3-1b:8192", "gemma3:8192", "gemma3:32000"],
                    help="MODEL:TOKENS runs of part 1 (models: " + ", ".join(MODELS) + ")")
    ap.add_argument("--threads", type=int, default=0, help="engine threads in part 1 (0: all)")
    ap.add_argument("--system-tokens", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--window-tokens", type=int, default=8192, help="the prompt of part 3")
    ap.add_argument("--max-batch-tokens", type=int, default=512, help="engine step of part 3")
    ap.add_argument("--parts", default="long,tiers,window",
                    help="which parts to run (comma-separated: long, tiers, window)")
    ap.add_argument("--drop-caches", action=argparse.BooleanOptionalAction, default=os.geteuid() == 0,
                    help="drop the page cache before the disk hits (default: when root)")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    report = {}
    if "long" in parts:
        long_prompts(a, report)
    if "tiers" in parts:
        prefix_tiers(a, report)
    if "window" in parts:
        window_kv(a, report)
    os.makedirs(".bench", exist_ok=True)
    with open(".bench/long_context.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
