#!/usr/bin/env python3
"""What the lossy KV policies cost in quality: perplexity on a public-domain text of 20K+
tokens (Verne's "Around the World in Eighty Days") with full attention and with each policy at
each KV budget, in one run on this machine.

Every run scores the same tokens: --windows windows of --ctx tokens, each from a fresh
sequence. Full attention sees the whole window so far; a policy streams the window one block
per step and keeps at most its budget (`pdmesh perplexity --kv-policy P`). The table gives each
perplexity, its ratio to full attention, and, per policy, the smallest budget within --within
(5%) of full.

Usage (`just bench-kv-policy` builds the release binary first):
  python3 scripts/bench_kv_policy.py [--model M] [--ctx 8192] [--windows 3]
      [--budgets 1024,2048,4096] [--policies sinks,h2o] [--within 0.05]
"""
import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
PDMESH = ROOT / "target" / "release" / "pdmesh"


def perplexity(text, args, policy=None):
    cmd = [str(PDMESH), "perplexity", "--file", str(text), "--ctx", str(args.ctx),
           "--max-windows", str(args.windows)]
    if args.model:
        cmd += ["--model", args.model]
    if policy:
        cmd += ["--kv-policy", policy]
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed:\n{out.stderr}")
    ppl = re.search(r"^perplexity: ([0-9.]+)", out.stdout, re.M)
    scored = re.search(r"^scored (\d+) tokens", out.stdout, re.M)
    if not ppl or not scored:
        raise SystemExit(f"unexpected `pdmesh perplexity` output:\n{out.stdout}\n{out.stderr}")
    secs = time.monotonic() - start
    print(f"{policy or 'full':<16} ppl {float(ppl.group(1)):.4f} ({secs:.0f} s)", file=sys.stderr)
    return float(ppl.group(1)), int(scored.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF path (the default model when left out)")
    ap.add_argument("--ctx", type=int, default=8192, help="window length in tokens")
    ap.add_argument("--windows", type=int, default=3, help="windows scored")
    ap.add_argument("--budgets", default="1024,2048,4096", help="KV budgets in tokens")
    ap.add_argument("--policies", default="sinks,h2o", help="policies (sinks, h2o)")
    ap.add_argument("--within", type=float, default=0.05, help="tolerated perplexity increase")
    args = ap.parse_args()
    if not PDMESH.exists():
        sys.exit(f"error: {PDMESH} is missing; run `just bench-kv-policy` (it builds it)")
    budgets = [int(b) for b in args.budgets.split(",")]
    policies = args.policies.split(",")

    from verne import verne_path, verne_text
    with tempfile.TemporaryDirectory() as d:
        text = Path(d) / "verne.txt"
        text.write_text(verne_text(verne_path()), encoding="utf-8")
        full, scored = perplexity(text, args)
        runs = {(p, b): perplexity(text, args, f"{p}:{b}")[0] for p in policies for b in budgets}

    print(f"\nperplexity of Verne: {scored} tokens scored in {args.windows} windows of {args.ctx}, "
          f"model {args.model or 'default'}")
    print(f"{'policy':<8} {'budget':>7} {'ppl':>9} {'x full':>8}")
    print(f"{'full':<8} {'-':>7} {full:>9.4f} {1.0:>8.4f}")
    for (p, b), ppl in runs.items():
        print(f"{p:<8} {b:>7} {ppl:>9.4f} {ppl / full:>8.4f}")
    for p in policies:
        ok = [b for b in budgets if runs[(p, b)] <= full * (1 + args.within)]
        name = f"{min(ok)} tokens" if ok else f"none of {args.budgets}"
        print(f"{p}: smallest budget within {args.within:.0%} of full attention: {name}")


if __name__ == "__main__":
    main()
