#!/usr/bin/env python3
"""The CUDA backend's speed on GPU 0 (`just bench-gpu`): for each model, prefill tok/s of a
512- and a 2,048-token prompt, and decode tok/s at batch 1, 16 and 64 with the weight bytes each
step streams from HBM (GB/s; a decode step reads every weight once, whatever the batch), next to
the H200's 4.8 TB/s. Each figure is the median of `--repeats` runs of `pdmesh bench engine`.
With them, decode at batch 64 with top-40 samplers, picking from the candidates the device
cuts each row to against picking from whole logits read back; and prefill again with
`--cuda-mma` (prompt matmuls of the quantized formats on the int8 tensor cores), then with
`--cuda-flash` added (prompt attention with flash attention's running softmax), as ratios.

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


def run_json(cmd):
    """The last stdout line of `cmd` as JSON; on failure, its stderr's end and an error."""
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise RuntimeError(f"`{' '.join(cmd[1:3])}` exited with {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(a, model, prompt, batches, sampled=0, flags=()):
    return run_json([
        a.pdmesh, "bench", "engine", "--backend", a.backend, "--json",
        "--model", model,
        "--prompt-tokens", str(prompt),
        "--max-batch-tokens", str(max(prompt, max(batches))),
        "--batch-sizes", ",".join(str(b) for b in batches),
        "--repeats", str(a.repeats),
        "--sampled-batch", str(sampled),
    ] + list(flags))


def kv_into_gpu(a, model):
    return run_json([a.pdmesh, "bench", "kv", "--json", "--model", model, "--tokens",
                     str(a.kv_tokens), "--reps", str(max(a.repeats, 3)), "--decode-backend",
                     a.backend, "--paths", "ucx,ucx-put"])


def model_result(a, model):
    short_p, long_p = a.prompt_tokens
    batches = a.batch_sizes
    short = bench(a, model, short_p, batches, sampled=max(batches))
    long = bench(a, model, long_p, [1])
    # The bounded kernels are CUDA options; the CPU backend refuses them.
    def prefill(flags):
        if a.backend != "cuda":
            return {}
        return {str(p): bench(a, model, p, [1], flags=flags)["prefill_tok_s"]
                for p in (short_p, long_p)}
    mma = prefill(["--cuda-mma"])
    flash = prefill(["--cuda-mma", "--cuda-flash"])
    weights = short["decode_weight_bytes_per_token"]
    rows = {}
    for b in batches:
        tok_s = short["batched_decode_tok_s"][str(b)]
        rows[b] = (tok_s, weights * tok_s / b / 1e9)
    return {
        "model": model,
        "backend": short["backend"],
        "prefill_tok_s": {str(short_p): short["prefill_tok_s"], str(long_p): long["prefill_tok_s"]},
        "prefill_mma_tok_s": mma,
        "prefill_mma_flash_tok_s": flash,
        "decode": {str(b): {"tok_s": t, "weight_gb_s": g} for b, (t, g) in rows.items()},
        "weight_bytes_per_step": weights,
        "sampled_decode": short["sampled_decode"],
    }


def print_model(r):
    weights = r["weight_bytes_per_step"]
    print(f"{r['model']}  on {r['backend']}  ({weights / 1e6:.1f} MB of weights per step)")
    for p, tok_s in r["prefill_tok_s"].items():
        mma = r["prefill_mma_tok_s"].get(p)
        flash = r["prefill_mma_flash_tok_s"].get(p)
        extra = f"; tensor cores {mma:.1f} tok/s ({mma / tok_s:.3f}x)" if mma else ""
        if flash:
            extra += f", with flash attention {flash:.1f} tok/s ({flash / tok_s:.3f}x)"
        print(f"  prefill  {p:>4} tokens {tok_s:>10.1f} tok/s{extra}")
    for b, d in r["decode"].items():
        g = d["weight_gb_s"]
        print(f"  decode  batch {b:>3}    {d['tok_s']:>10.1f} tok/s  {g:>8.1f} GB/s "
              f"= {100 * g / H200_HBM_GB_S:.1f}% of the H200's {H200_HBM_GB_S:.0f} GB/s")
    s = r["sampled_decode"]
    print(f"  decode  batch {s['batch']:>3} top-{s['top_k']} {s['candidates_tok_s']:>10.1f} tok/s "
          f"from device candidates, {s['whole_logits_tok_s']:.1f} from whole logits "
          f"({s['ratio']:.3f}x)", flush=True)


def print_kv(kv, tokens):
    print(f"KV of {tokens} tokens ({kv['bytes'] / 1e6:.1f} MB) "
          f"into a decode pool on {kv['decode_backend']}, memcpy {kv['memcpy_gbps']:.2f} GB/s:")
    for path in ("ucx", "ucx_put"):
        print(f"  {path:8} into {kv[path + '_kv_path']:12} {kv[path + '_gbps']:8.2f} GB/s "
              f"({kv[path + '_vs_memcpy']:.3f} of memcpy; the copy into the pool "
              f"{kv[path + '_unstage_ms']:.2f} of {kv[path + '_ms']:.2f} ms)", flush=True)


def ints(s):
    return [int(x) for x in s.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pdmesh", default="target/release/pdmesh")
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="cuda",
                    help="cuda (the point); cpu only checks this script's plumbing")
    ap.add_argument("--prompt-tokens", type=ints, default=[512, 2048],
                    help="the short and the long prompt (default 512,2048)")
    ap.add_argument("--batch-sizes", type=ints, default=[1, 16, 64],
                    help="decode batch sizes (default 1,16,64; the largest also runs sampled)")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--json", action="store_true", help="one JSON object per line, no text")
    ap.add_argument("--json-out", help="also write the JSON lines to this file")
    a = ap.parse_args()
    if len(a.prompt_tokens) != 2:
        ap.error("--prompt-tokens takes two sizes: the short and the long prompt")
    results, failed = [], []

    def emit(obj, show):
        results.append(obj)
        if a.json:
            print(json.dumps(obj), flush=True)
        else:
            show(obj)

    for model in a.models:
        try:
            emit(model_result(a, model), print_model)
        except Exception as e:  # one model's failure must not lose the others' numbers
            failed.append(f"{model}: {e}")
            print(f"FAILED {model}: {e}", file=sys.stderr, flush=True)
    try:
        emit({"kv_into_gpu": kv_into_gpu(a, a.models[0])}, lambda o: print_kv(o["kv_into_gpu"], a.kv_tokens))
    except Exception as e:
        failed.append(f"kv: {e}")
        print(f"FAILED kv: {e}", file=sys.stderr, flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    if failed:
        sys.exit("failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
