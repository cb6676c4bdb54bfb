#!/usr/bin/env python3
"""What a q8_0 KV cache buys and costs against f16, in one run on this machine:

  transfer   `pdmesh bench kv --kv-dtype D` for f16 and q8_0, alternating, --rounds times:
             the bytes one prompt's KV takes and the median time per transport (UCX, gRPC),
             each as a ratio q8_0 / f16
  quality    `pdmesh perplexity --kv-dtype D` on a public-domain text (Verne's "Around the
             World in Eighty Days", the copy in the esaxx-rs crate) for f16, q8_0 and
             q8_0-norot, in windows of --ctx tokens

Usage (`just bench-kv-dtype` builds the release binary first; the bench venv has gguf, which
the text's locator in make_vocab_fixtures.py imports):
  .bench/venv/bin/python scripts/bench_kv_dtype.py [--tokens 4096] [--reps 7] [--rounds 3]
      [--ctx 512] [--windows 40]
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
PDMESH = ROOT / "target" / "release" / "pdmesh"


def bench_kv(dtype, args):
    out = subprocess.run(
        [str(PDMESH), "bench", "kv", "--json", "--kv-dtype", dtype, "--tokens", str(args.tokens),
         "--reps", str(args.reps)],
        cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def perplexity(dtype, text, args):
    out = subprocess.run(
        [str(PDMESH), "perplexity", "--file", str(text), "--ctx", str(args.ctx), "--max-windows",
         str(args.windows), "--kv-dtype", dtype],
        cwd=ROOT, check=True, capture_output=True, text=True)
    ppl = re.search(r"^perplexity: ([0-9.]+)", out.stdout, re.M)
    scored = re.search(r"^scored (\d+) tokens", out.stdout, re.M)
    if not ppl or not scored:
        raise SystemExit(f"unexpected `pdmesh perplexity` output:\n{out.stdout}\n{out.stderr}")
    return float(ppl.group(1)), int(scored.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length whose KV moves")
    ap.add_argument("--reps", type=int, default=7, help="transfers per transport per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating f16/q8_0 bench rounds")
    ap.add_argument("--ctx", type=int, default=512, help="perplexity window")
    ap.add_argument("--windows", type=int, default=40, help="perplexity windows (0 = all)")
    args = ap.parse_args()
    if not PDMESH.exists():
        sys.exit(f"error: {PDMESH} is missing; run `just bench-kv-dtype` (it builds it)")

    runs = {"f16": [], "q8_0": []}
    for r in range(args.rounds):
        for dtype in runs:
            rep = bench_kv(dtype, args)
            runs[dtype].append(rep)
            print(f"round {r + 1} {dtype}: {rep['bytes'] / 1e6:.1f} MB, ucx {rep['ucx_ms']:.2f} ms, "
                  f"grpc {rep['grpc_ms']:.2f} ms, memcpy {rep['memcpy_ms']:.2f} ms", file=sys.stderr)
    med = {d: {k: statistics.median(x[k] for x in v) for k in ("ucx_ms", "grpc_ms", "memcpy_ms")}
           for d, v in runs.items()}
    size = {d: v[0]["bytes"] for d, v in runs.items()}
    print(f"\nKV of {args.tokens} tokens, median of {args.rounds} rounds x {args.reps} transfers")
    print(f"{'':<10} {'f16':>10} {'q8_0':>10} {'q8_0/f16':>10}")
    print(f"{'MB':<10} {size['f16'] / 1e6:>10.2f} {size['q8_0'] / 1e6:>10.2f} "
          f"{size['q8_0'] / size['f16']:>10.3f}")
    for k, name in (("ucx_ms", "ucx ms"), ("grpc_ms", "grpc ms"), ("memcpy_ms", "memcpy ms")):
        f, q = med["f16"][k], med["q8_0"][k]
        print(f"{name:<10} {f:>10.2f} {q:>10.2f} {q / f:>10.3f}")

    from verne import verne_path, verne_text
    with tempfile.TemporaryDirectory() as d:
        text = Path(d) / "verne.txt"
        text.write_text(verne_text(verne_path()), encoding="utf-8")
        ppl = {dtype: perplexity(dtype, text, args) for dtype in ("f16", "q8_0", "q8_0-norot")}
    scored = ppl["f16"][1]
    print(f"\nperplexity of Verne ({scored} tokens, windows of {args.ctx}, default model)")
    for dtype, (p, _) in ppl.items():
        print(f"{dtype:<11} {p:>10.4f} {p / ppl['f16'][0]:>10.4f} x f16")


if __name__ == "__main__":
    main()
