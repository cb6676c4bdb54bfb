#!/usr/bin/env python3
"""The CUDA backend's speed on GPU 0 (`just bench-gpu`): for each model, prefill tok/s of a
512- and a 2,048-token prompt, and decode tok/s at batch 1, 16 and 64 with the weight bytes each
step streams from HBM (GB/s; a decode step reads every weight once, whatever the batch), next to
the H200's 4.8 TB/s. Each figure is the median of `--repeats` runs of `pdmesh bench engine`.
With them, decode at batch 64 with top-40 samplers, picking from the candidates the device
cuts each row to against picking from whole logits read back; and prefill again with
`--cuda-mma` (prompt matmuls of the 32-element formats on the int8 tensor cores), as a ratio.

Then KV into a GPU decode node's pool through UCX (`pdmesh bench kv --decode-backend cuda`):
a 4,096-token prompt's KV from host bytes (what a prefill node reads back from its GPU) into
the pool by the path the node takes (`kv_path`: `direct-cuda` with a CUDA-enabled UCX, else
`staged-cuda`: host staging blocks and a host-to-device copy at the commit), in GB/s against
an in-process memcpy of the same bytes, with the copy's share.
"""

import argparse
import json
import subprocess
import sys

H200_HBM_GB_S = 4800.0


def bench(pdmesh, model, prompt, batches, repeats, sampled=0, mma=False):
    cmd = [
        pdmesh, "bench", "engine", "--backend", "cuda", "--json",
        "--model", model,
        "--prompt-tokens", str(prompt),
        "--max-batch-tokens", str(prompt),
        "--batch-sizes", ",".join(str(b) for b in batches),
        "--repeats", str(repeats),
        "--sampled-batch", str(sampled),
    ] + (["--cuda-mma"] if mma else [])
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def kv_into_gpu(pdmesh, model, repeats):
    cmd = [pdmesh, "bench", "kv", "--json", "--model", model, "--tokens", "4096",
           "--reps", str(max(repeats, 3)), "--decode-backend", "cuda", "--paths", "ucx,ucx-put"]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pdmesh", default="target/release/pdmesh")
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object per model")
    a = ap.parse_args()
    batches = [1, 16, 64]
    for model in a.models:
        short = bench(a.pdmesh, model, 512, batches, a.repeats, sampled=64)
        long = bench(a.pdmesh, model, 2048, [1], a.repeats)
        mma = {p: bench(a.pdmesh, model, p, [1], a.repeats, mma=True)["prefill_tok_s"]
               for p in (512, 2048)}
        weights = short["decode_weight_bytes_per_token"]
        rows = {}
        for b in batches:
            tok_s = short["batched_decode_tok_s"][str(b)]
            gb_s = weights * tok_s / b / 1e9
            rows[b] = (tok_s, gb_s)
        result = {
            "model": model,
            "backend": short["backend"],
            "prefill_tok_s": {"512": short["prefill_tok_s"], "2048": long["prefill_tok_s"]},
            "prefill_mma_tok_s": {str(p): v for p, v in mma.items()},
            "decode": {str(b): {"tok_s": t, "weight_gb_s": g} for b, (t, g) in rows.items()},
            "weight_bytes_per_step": weights,
            "sampled_decode": short["sampled_decode"],
        }
        if a.json:
            print(json.dumps(result))
            continue
        print(f"{model}  on {short['backend']}  ({weights / 1e6:.1f} MB of weights per step)")
        for p, r in ((512, short), (2048, long)):
            print(f"  prefill  {p:>4} tokens {r['prefill_tok_s']:>10.1f} tok/s; tensor cores "
                  f"{mma[p]:.1f} tok/s ({mma[p] / r['prefill_tok_s']:.3f}x)")
        for b, (t, g) in rows.items():
            print(f"  decode  batch {b:>3}    {t:>10.1f} tok/s  {g:>8.1f} GB/s "
                  f"= {100 * g / H200_HBM_GB_S:.1f}% of the H200's {H200_HBM_GB_S:.0f} GB/s")
        s = short["sampled_decode"]
        print(f"  decode  batch {s['batch']:>3} top-{s['top_k']} {s['candidates_tok_s']:>10.1f} tok/s "
              f"from device candidates, {s['whole_logits_tok_s']:.1f} from whole logits "
              f"({s['ratio']:.3f}x)")
    kv = kv_into_gpu(a.pdmesh, a.models[0], a.repeats)
    if a.json:
        print(json.dumps({"kv_into_gpu": kv}))
        return
    print(f"KV of 4096 tokens ({kv['bytes'] / 1e6:.1f} MB) into a GPU decode pool "
          f"({kv['decode_backend']}), memcpy {kv['memcpy_gbps']:.2f} GB/s:")
    for path in ("ucx", "ucx_put"):
        print(f"  {path:8} into {kv[path + '_kv_path']:12} {kv[path + '_gbps']:8.2f} GB/s "
              f"({kv[path + '_vs_memcpy']:.3f} of memcpy; the copy into the pool "
              f"{kv[path + '_unstage_ms']:.2f} of {kv[path + '_ms']:.2f} ms)")


if __name__ == "__main__":
    main()
