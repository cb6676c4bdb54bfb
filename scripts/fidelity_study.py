#!/usr/bin/env python3
"""What pdmesh's one set of numerics costs across CPUs: teacher-forced logits over a
public-domain text (Verne's "Around the World in Eighty Days") from

  llama.cpp native      llama-cpp-python built for this CPU (.bench/venv; AVX-512 here)
  llama.cpp AVX2        the same version built with AVX-512 off (.bench/venv-avx2)
  pdmesh                `pdmesh dump-logits`, whatever the CPU

each in windows of --ctx tokens (a fresh sequence per window). For every pair it prints the
rows that are bit-identical, top-1 agreement and the largest |logit difference|; for every
engine the perplexity (every token of a window scored except its first). llama.cpp runs with
the settings pdmesh matches bit for bit (micro-batches of 4, no weight repacking, flash
attention off, f16 KV; see scripts/arch_reference.py).

Usage (`just fidelity-study` builds both llama.cpp copies first):
  .bench/venv/bin/python scripts/fidelity_study.py [--models M.gguf ...] [--ctx 512] [--windows 4]
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
DEFAULT_MODELS = ["models/SmolLM2-135M-Instruct.Q4_1.gguf", "models/test/smollm2-Q4_K_M.gguf",
                  "models/test/smollm2-F16.gguf"]
THREADS = 2  # as arch_reference.THREADS, for pdmesh


def worker(args):
    """Runs inside one llama-cpp-python build: tokenizes (when asked) and writes the logits."""
    import llama_cpp
    from arch_reference import context_params, model_params

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), model_params())
    if not model:
        sys.exit(f"llama.cpp could not load {args.model}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    if args.text:
        from verne import verne_path, verne_text
        data = verne_text(verne_path()).encode()
        buf = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
        tokens = list(buf[:min(n, args.ctx * args.windows)])
        Path(args.tokens).write_text(json.dumps(tokens))
    tokens = json.loads(Path(args.tokens).read_text())
    ctx = llama_cpp.llama_init_from_model(model, context_params(args.ctx))
    mem = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(args.ctx, 0, 1)
    with open(args.out, "wb") as out:
        for w in range(0, len(tokens), args.ctx):
            window = tokens[w:w + args.ctx]
            llama_cpp.llama_memory_clear(mem, True)
            for i, t in enumerate(window):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, True
            batch.n_tokens = len(window)
            if llama_cpp.llama_decode(ctx, batch):
                sys.exit("llama_decode failed")
            for i in range(len(window)):
                row = llama_cpp.llama_get_logits_ith(ctx, i)
                np.ctypeslib.as_array(row, shape=(n_vocab,)).astype("<f4").tofile(out)
    print(llama_cpp.llama_print_system_info().decode().strip())


def perplexity(logits, tokens, ctx):
    nll = []
    for w in range(0, len(tokens), ctx):
        rows, ids = logits[w:w + ctx], tokens[w:w + ctx]
        for i in range(len(ids) - 1):
            x = rows[i].astype(np.float64)
            m = x.max()
            nll.append(m + np.log(np.exp(x - m).sum()) - x[ids[i + 1]])
    return float(np.exp(np.mean(nll)))


def compare(a, b):
    same = int(sum(np.array_equal(x, y) for x, y in zip(a, b)))
    top1 = float(np.mean(a.argmax(axis=1) == b.argmax(axis=1)))
    return same, top1, float(np.abs(a - b).max())


def study(model, args, tmp):
    tokens_file = tmp / "tokens.json"
    files, info = {}, {}
    for name, py in (("llama.cpp native", args.native_python), ("llama.cpp AVX2", args.avx2_python)):
        files[name] = tmp / f"{len(files)}.f32"
        cmd = [py, __file__, "--worker", "--model", str(model), "--tokens", str(tokens_file),
               "--out", str(files[name]), "--ctx", str(args.ctx), "--windows", str(args.windows)]
        if not tokens_file.exists():
            cmd.append("--text")
        info[name] = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()
    tokens = json.loads(tokens_file.read_text())
    files["pdmesh"] = tmp / "pdmesh.f32"
    with open(files["pdmesh"], "wb") as out:
        for w in range(0, len(tokens), args.ctx):
            part = tmp / "window.f32"
            ids = ",".join(map(str, tokens[w:w + args.ctx]))
            subprocess.run([args.pdmesh, "dump-logits", "--model", str(model), "--threads",
                            str(THREADS), "--tokens", ids, "--out", str(part)], check=True,
                           capture_output=True)
            out.write(part.read_bytes())
    logits = {k: np.fromfile(f, dtype="<f4").reshape(len(tokens), -1) for k, f in files.items()}
    print(f"\n{model.name}: {len(tokens)} tokens of Verne in windows of {args.ctx}")
    for name, line in info.items():
        print(f"  {name}: {line}")
    print(f"  {'pair':<38}{'identical rows':>16}{'top-1 agree':>13}{'max |diff|':>12}")
    names = list(logits)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            same, top1, diff = compare(logits[a], logits[b])
            print(f"  {a + ' vs ' + b:<38}{f'{same}/{len(tokens)}':>16}{top1:>13.4f}{diff:>12.4g}")
    for name, lg in logits.items():
        print(f"  perplexity {name:<20}{perplexity(lg, tokens, args.ctx):.6f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--native-python", default=str(ROOT / ".bench/venv/bin/python"))
    ap.add_argument("--avx2-python", default=str(ROOT / ".bench/venv-avx2/bin/python"))
    ap.add_argument("--pdmesh", default=str(ROOT / "target/release/pdmesh"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--text", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ctx < 2 or args.windows < 1:
        sys.exit("error: --ctx must be at least 2 and --windows at least 1")
    if args.worker:
        return worker(args)
    for m in args.models:
        model = Path(m)
        if not model.exists():
            sys.exit(f"error: {model} is missing (just fetch-model / just test-models)")
        with tempfile.TemporaryDirectory() as tmp:
            study(model, args, Path(tmp))


if __name__ == "__main__":
    main()
