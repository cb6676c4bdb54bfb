#!/usr/bin/env python3
"""llama.cpp's prompt logits on the synthetic architecture models, for
services/engine/tests/architectures.rs.

For each models/test/synth-ARCH-FMT.gguf given (default: every llama3, qwen2, qwen3 and mistral
one present), writes next to it
  X.ubatch4.f32         every prompt position's logits (raw little-endian float32, n_vocab
                        each), from one llama_decode of the whole prompt with n_ubatch = 4
  X.ubatch4.decode.f32  the logits of the next DECODE_STEPS greedy tokens, each fed alone
                        (llama.cpp's single-token path, which sums attention in another order)
  X.ubatch4.json        the prompt's text and token ids, the greedy tokens, n_vocab, the
                        settings and the model's size and sha256
with flash attention off, f16 KV, 2 threads and weight repacking off.

With --kv q8_0 (or q8_0-norot) the files are X.ubatch4.q8_0.{f32,decode.f32,json}: llama.cpp
with q8_0 K and V, which it computes only with flash attention on (one code path for prompt and
decode rows), and with its default Hadamard rotation of Q/K/V around attention; q8_0-norot is
the same with LLAMA_ATTN_ROT_DISABLE=1. pdmesh's `--kv-dtype` of the same name matches each.

Why n_ubatch 4: llama.cpp picks its matmul kernels by micro-batch size. With 2 to 4 rows it
runs the per-row dot products pdmesh reproduces; from 8 rows on, K-quant weights go through a
tiled kernel that sums in another order, and a micro-batch of 1 takes yet another path. The
X.ref.batch/single files of make_test_models.py are those other paths, so they are not bit
targets for pdmesh. Why repacking off: with it (the high-level `Llama` class's default) llama.cpp
rewrites Q4_0 and Q4_K weights into interleaved layouts with kernels of their own on AVX-512.

With --long N (a multiple of 4) the prompt is the first N tokens of Verne's "Around the World in
Eighty Days" (public domain; cargo's copy in the esaxx-rs crate) and the files are
models/test/X.long{N}.ubatch4.* (in the test-model cache, whatever directory X is in; rewritten
only when the model, llama.cpp or this script changed): only the rows of every 256th group of 4 positions and of the last group are
kept (the prompt's every logit of a 262,144-token vocabulary would be gigabytes), listed in the
JSON's "rows". Every position still asks llama.cpp for its logits, so that every micro-batch
computes as in the short runs (a micro-batch with one output row would take another path in
its last layer). For Gemma 3's window layers: sliding-window attention over a cache as long as
the context (swa_full, llama.cpp's default), whose cells are then in position order as pdmesh's
summation lanes are.

Also writes ggml-gelu-f16.bin next to the models: llama.cpp's GELU table (ggml_table_gelu_f16,
65,536 f16 values), which the engine's own must equal.

Usage: .bench/venv/bin/python scripts/arch_reference.py [--long N] [MODEL.gguf ...]
"""
import argparse
import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path

try:
    import llama_cpp
    import numpy as np
except ImportError as e:
    sys.exit(f"error: {e.name} is missing; run this with .bench/venv/bin/python "
             "(`just compare-llamacpp` installs llama-cpp-python there)")

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models" / "test"
FAMILIES = ("smollm2", "synth-llama3", "synth-qwen2", "synth-qwen3", "synth-mistral",
            "synth-gemma3")
# The prompt of make_test_models.py, so that both scripts' files describe the same tokens.
PROMPT = ("The old lighthouse keeper climbed the stairs every evening at seven, counting all "
          "1,234 steps, because he believed the ships at sea depended on him alone.")
THREADS = 2
N_UBATCH = 4
N_CTX = 256
DECODE_STEPS = 32


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class Log:
    """Keeps llama.cpp's log to show on failure instead of flooding stderr."""

    def __init__(self):
        self.lines = []
        # ctypes drops the callback when its Python object dies: keep it on self.
        self._cb = llama_cpp.llama_log_callback(
            lambda level, text, user: self.lines.append(text.decode("utf-8", "replace")))
        llama_cpp.llama_log_set(self._cb, ctypes.c_void_p(0))

    def tail(self, n=30):
        return "".join(self.lines[-n:])


LOG = Log()


def model_params():
    """Loading as pdmesh's reference path needs it: CPU only, weight repacking off."""
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = False
    return params


KV_TYPES = ("f16", "q8_0", "q8_0-norot")


def context_params(n_ctx, kv):
    """A context that computes what pdmesh reproduces bit for bit: micro-batches of N_UBATCH,
    THREADS threads, and for f16 KV flash attention off; a q8_0 cache needs it on."""
    p = llama_cpp.llama_context_default_params()
    p.n_ctx = p.n_batch = n_ctx
    # Window layers' cache as long as the context: cells in position order (see above).
    p.swa_full = True
    p.n_ubatch = N_UBATCH
    p.n_seq_max = 1
    p.n_threads = p.n_threads_batch = THREADS
    if kv == "f16":
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = llama_cpp.GGML_TYPE_F16
    else:
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        p.type_k = p.type_v = llama_cpp.GGML_TYPE_Q8_0
    return p


def init_context(model, kv, n_ctx):
    """The context for `kv`; llama.cpp reads LLAMA_ATTN_ROT_DISABLE once, when the cache is
    made, so it is set only around this call."""
    if kv == "q8_0-norot":
        os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
    try:
        ctx = llama_cpp.llama_init_from_model(model, context_params(n_ctx, kv))
    finally:
        os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
    if not ctx:
        raise RuntimeError(f"llama_init_from_model failed:\n{LOG.tail()}")
    if kv != "f16" and not any("q8_0" in line for line in LOG.lines):
        raise RuntimeError(f"llama.cpp did not make a q8_0 cache:\n{LOG.tail()}")
    if kv == "q8_0-norot":
        for line in LOG.lines:
            if "attn_rot_k" in line and "= 0" not in line:
                raise RuntimeError(f"rotation is not off for {kv}: {line.strip()}")
    return ctx


def reference(path, kv, text=PROMPT, n_tokens=None):
    """llama.cpp's tokens of `text` (cut to `n_tokens`), the logits of every prompt position,
    the greedy tokens after it and the logits of each fed alone."""
    LOG.lines.clear()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}:\n{LOG.tail()}")
    if any("REPACK" in ln for ln in LOG.lines):
        raise RuntimeError(f"weight repacking is not off for {path}")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)
        if n <= 0:
            raise RuntimeError(f"llama_tokenize returned {n}")
        tokens = list(buf[:n])
        if n_tokens is not None:
            if len(tokens) < n_tokens:
                raise RuntimeError(f"the text has {len(tokens)} tokens, fewer than {n_tokens}")
            tokens = tokens[:n_tokens]
        n_ctx = max(N_CTX, (len(tokens) + DECODE_STEPS + 1 + 255) // 256 * 256)

        ctx = init_context(model, kv, n_ctx)
        try:
            batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
            try:
                for i, t in enumerate(tokens):
                    batch.token[i] = t
                    batch.pos[i] = i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = True
                batch.n_tokens = len(tokens)
                if llama_cpp.llama_decode(ctx, batch):
                    raise RuntimeError(f"llama_decode failed:\n{LOG.tail()}")
                rows = [logits_row(ctx, i, n_vocab) for i in kept_rows(len(tokens), n_tokens)]
                last = logits_row(ctx, len(tokens) - 1, n_vocab)
            finally:
                llama_cpp.llama_batch_free(batch)
            # Greedy continuation, one token per llama_decode; ties go to the lowest id.
            greedy, decoded = [int(np.argmax(last))], []
            for _ in range(DECODE_STEPS):
                one = (llama_cpp.llama_token * 1)(greedy[-1])
                if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(one, 1)):
                    raise RuntimeError(f"llama_decode failed:\n{LOG.tail()}")
                decoded.append(logits_row(ctx, -1, n_vocab))
                greedy.append(int(np.argmax(decoded[-1])))
        finally:
            llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    return (tokens, n_vocab, np.stack(rows).astype("<f4"), greedy[:DECODE_STEPS],
            np.stack(decoded).astype("<f4"))


def kept_rows(n, long):
    """The prompt rows kept: all of a short prompt; for a long one, every 256th group of 4
    positions and the last group (each a whole micro-batch)."""
    if long is None:
        return list(range(n))
    starts = sorted(set(range(256, n - 4, 256)) | {n - 4})
    return [g + i for g in starts for i in range(4)]


def gelu_table():
    """llama.cpp's GELU table, as its CPU backend filled it at start-up."""
    import glob
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(glob.glob(str(lib_dir / "libggml-cpu.so"))[0])
    lib.ggml_cpu_init()
    table = (ctypes.c_uint16 * 65536).in_dll(lib, "ggml_table_gelu_f16")
    return np.frombuffer(bytes(table), dtype="<u2")


def verne():
    sys.path.insert(0, str(ROOT / "scripts"))
    from verne import verne_path, verne_text
    return verne_text(verne_path())


def fresh(json_path, model, script_sha):
    """Whether `json_path` is this script's reference, under this llama.cpp, for `model` as it
    is now (its logits files written before it)."""
    try:
        meta = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return False
    return (meta.get("script_sha256") == script_sha
            and meta.get("llama_cpp_version") == llama_cpp.__version__
            and meta.get("model_size") == model.stat().st_size
            and meta.get("model_sha256") == sha256_file(model))


def logits_row(ctx, i, n_vocab):
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()


def write(path, array):
    tmp = path.with_suffix(".tmp")
    array.tofile(tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--long", type=int, metavar="N",
                    help="a prompt of the first N tokens of Verne's novel (N a multiple of 4), "
                         "keeping every 256th group of rows")
    ap.add_argument("--kv", choices=KV_TYPES, default="f16",
                    help="llama.cpp's type_k/type_v (default f16; the files then have no KV "
                         "suffix)")
    args = ap.parse_args()
    models = args.models or sorted(p for f in FAMILIES for p in MODELS.glob(f"{f}-*.gguf"))
    if not models:
        sys.exit(f"error: no synth-* models in {MODELS}; make them first "
                 "(scripts/make_test_models.py)")
    if args.long is not None and (args.long < 8 or args.long % 4):
        sys.exit(f"error: --long {args.long}: give a multiple of 4, at least 8")
    llama_cpp.llama_backend_init()
    write(MODELS / "ggml-gelu-f16.bin", gelu_table())
    text = PROMPT
    if args.long is not None:
        # Enough characters for N tokens at any tokenizer's rate (~4 characters a token), cut
        # at a line end.
        novel = verne()
        text = novel[:novel.index("\n", min(len(novel) - 1, args.long * 8))]
    script_sha = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    for path in models:
        stem = path.name.removesuffix(".gguf")
        tag = "ubatch4" if args.kv == "f16" else f"ubatch4.{args.kv}"
        at = path
        if args.long is not None:
            tag = f"long{args.long}.{tag}"
            at = MODELS / path.name
            if fresh(at.with_name(f"{stem}.{tag}.json"), path, script_sha):
                print(f"{stem}.{tag}: up to date", file=sys.stderr)
                continue
        tokens, n_vocab, logits, greedy, decoded = reference(path, args.kv, text, args.long)
        out = at.with_name(f"{stem}.{tag}.f32")
        write(out, logits)
        decode_out = at.with_name(f"{stem}.{tag}.decode.f32")
        write(decode_out, decoded)
        meta = {
            "model": path.name,
            "model_sha256": sha256_file(path),
            # The test's check that this reference is for the file there now.
            "model_size": path.stat().st_size,
            "prompt_text": text,
            "prompt_tokens": tokens,
            # The prompt rows `logits` holds, in order.
            "rows": kept_rows(len(tokens), args.long),
            "n_vocab": n_vocab,
            "logits": out.name,
            "argmax": [int(a) for a in logits.argmax(axis=1)],
            "swa_full": True,
            # Fed one at a time after the prompt; decode row i is the logits after greedy[i].
            "greedy": greedy,
            "decode_logits": decode_out.name,
            "settings": {"n_ctx": N_CTX if args.long is None else "prompt + decode, by 256",
                         "n_batch": "n_ctx", "n_ubatch": N_UBATCH,
                         "n_threads": THREADS, "flash_attn": args.kv != "f16",
                         "type_k": args.kv.removesuffix("-norot"),
                         "type_v": args.kv.removesuffix("-norot"),
                         "attn_rot": args.kv == "q8_0", "use_extra_bufts": False},
            "llama_cpp_version": llama_cpp.__version__,
            "script_sha256": script_sha,
            # Float weights take llama.cpp's AVX-512 (and AVX-512 BF16) kernels only when it
            # was built with them; the test bit-compares those formats only then.
            "system_info": llama_cpp.llama_print_system_info().decode(),
        }
        jtmp = at.with_name(f"{stem}.{tag}.json.tmp")
        jtmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(jtmp, at.with_name(f"{stem}.{tag}.json"))
        print(f"{stem} ({args.kv} KV): {len(tokens)} prompt positions and {len(greedy)} decoded x {n_vocab}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
