#!/usr/bin/env python3
"""Engine speed, pdmesh against llama.cpp on the same GGUF, same threads, in one run.

Measures, for each engine: prefill tokens/s of one 512-token prompt, single-stream decode
tokens/s over 128 tokens, and aggregate decode tokens/s with 1/4/16/32 sequences stepping
together (32-token prompts, 64 timed steps; llama.cpp through its low-level batch API with one
sequence id per stream). Prints both and the ratio pdmesh / llama.cpp: medians of --repeats
within a round; --rounds alternate the engines, and the ratio is the median of the rounds'.

Needs llama-cpp-python (``just bench-engine`` installs it into .bench/venv).
"""
import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time

import llama_cpp
from llama_cpp import Llama

# The same text `pdmesh bench engine` cycles through, so both see the same token ids.
TEXT = ("The history of computing is a story of layers. Each generation of engineers "
        "builds on the abstractions of the last: transistors become logic gates, gates become processors, "
        "processors run operating systems, and operating systems host the programs people use every day. "
        "Serving a language model adds one more layer. A prompt arrives, is split into tokens, and flows "
        "through dozens of transformer blocks; every block reads the keys and values of all earlier tokens "
        "from a cache that grows with the conversation. 1234567890 \u2014 na\u00efve caf\u00e9, \u6771\u4eac, emoji \U0001F680. ")


def cycle(tokens, n):
    return [tokens[i % len(tokens)] for i in range(n)]


class LlamaBench:
    def __init__(self, model, threads, n_ctx):
        self.llm = Llama(model_path=model, n_ctx=256, n_threads=threads, verbose=False)
        # Our own context: the high-level wrapper does not expose n_seq_max.
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = 512
        p.n_ubatch = 512
        p.n_seq_max = 64
        p.kv_unified = True
        p.n_threads = threads
        p.n_threads_batch = threads
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(self.llm._model.model, p)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = self.llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(512, 0, 64)

    def clear(self):
        llama_cpp.llama_memory_clear(self.mem, True)

    def decode(self, entries):
        """entries: (token, pos, seq, want_logits)"""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(self, i):
        p = llama_cpp.llama_get_logits_ith(self.ctx, i)
        arr = (ctypes.c_float * self.vocab).from_address(ctypes.addressof(p.contents))
        return _argmax(arr, self.vocab)


def _argmax(arr, n):
    import numpy as np
    return int(np.ctypeslib.as_array(arr, shape=(n,)).argmax())


def llama_measure(lb, text_tokens, args):
    out = {}
    prompt = cycle(text_tokens, args.prompt_tokens)
    t = []
    for _ in range(args.repeats):
        lb.clear()
        s = time.perf_counter()
        lb.decode([(tok, i, 0, i == len(prompt) - 1) for i, tok in enumerate(prompt)])
        llama_cpp.llama_synchronize(lb.ctx)
        t.append(time.perf_counter() - s)
    out["prefill_tok_s"] = args.prompt_tokens / statistics.median(t)

    short = cycle(text_tokens, 32)
    rates = []
    for _ in range(args.repeats):
        lb.clear()
        lb.decode([(tok, i, 0, i == len(short) - 1) for i, tok in enumerate(short)])
        nxt = lb.argmax(len(short) - 1)
        s = time.perf_counter()
        for k in range(args.decode_tokens):
            lb.decode([(nxt, len(short) + k, 0, True)])
            nxt = lb.argmax(0)
        rates.append(args.decode_tokens / (time.perf_counter() - s))
    out["decode_tok_s"] = statistics.median(rates)

    batched = {}
    bp = cycle(text_tokens, args.batch_prompt_tokens)
    for b in args.batch_sizes:
        rates = []
        for _ in range(args.repeats):
            lb.clear()
            nxt = []
            for seq in range(b):
                lb.decode([(tok, i, seq, i == len(bp) - 1) for i, tok in enumerate(bp)])
                nxt.append(lb.argmax(len(bp) - 1))
            s = time.perf_counter()
            for k in range(args.batch_steps):
                lb.decode([(nxt[seq], len(bp) + k, seq, True) for seq in range(b)])
                nxt = [lb.argmax(seq) for seq in range(b)]
            rates.append(b * args.batch_steps / (time.perf_counter() - s))
        batched[str(b)] = statistics.median(rates)
    out["batched_decode_tok_s"] = batched
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--pdmesh", default="target/release/pdmesh")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--batch-prompt-tokens", type=int, default=32)
    ap.add_argument("--batch-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternations of the two engines; ratios are per round, then their median")
    ap.add_argument("--simd", help="force pdmesh's kernel set (portable, avx2, avx512vnni)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]

    max_b = max(args.batch_sizes)
    n_ctx = max(args.prompt_tokens + 64, max_b * (args.batch_prompt_tokens + args.batch_steps) + 64,
                32 + args.decode_tokens + 64)
    lb = LlamaBench(args.model, args.threads, n_ctx)
    text_tokens = lb.llm.tokenize(TEXT.encode(), add_bos=False, special=True)
    cmd = [args.pdmesh, "bench", "engine", "--json", "--model", args.model, "--threads", str(args.threads),
           "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens),
           "--batch-sizes", ",".join(map(str, args.batch_sizes)),
           "--batch-prompt-tokens", str(args.batch_prompt_tokens), "--batch-steps", str(args.batch_steps),
           "--repeats", str(args.repeats)] + (["--simd", args.simd] if args.simd else [])

    def rows(ours, ref):
        r = [("prefill (pp%d)" % args.prompt_tokens, ours["prefill_tok_s"], ref["prefill_tok_s"]),
             ("decode (tg%d)" % args.decode_tokens, ours["decode_tok_s"], ref["decode_tok_s"])]
        for b in args.batch_sizes:
            r.append((f"batched decode x{b}", ours["batched_decode_tok_s"][str(b)],
                      ref["batched_decode_tok_s"][str(b)]))
        return r

    # Rounds alternate the engines, each round's ratio from measurements a minute apart at
    # most: on a shared machine the speed of both drifts by tens of percent over minutes, and
    # one engine measured wholly before the other would carry that drift into the ratio.
    rounds = []
    for k in range(args.rounds):
        print(f"round {k + 1}/{args.rounds}: llama.cpp ...", file=sys.stderr)
        ref = llama_measure(lb, text_tokens, args)
        print(f"round {k + 1}/{args.rounds}: pdmesh ...", file=sys.stderr)
        ours = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        rounds.append((ours, ref))
    del lb
    ours = rounds[-1][0]
    per_round = [rows(o, r) for o, r in rounds]
    table = []
    for i, (name, _, _) in enumerate(per_round[0]):
        o = statistics.median(pr[i][1] for pr in per_round)
        r = statistics.median(pr[i][2] for pr in per_round)
        ratios = [pr[i][1] / pr[i][2] for pr in per_round]
        table.append((name, o, r, statistics.median(ratios), min(ratios), max(ratios)))
    if args.json:
        print(json.dumps({"pdmesh": ours, "rounds": [{"pdmesh": o, "llama_cpp": r} for o, r in rounds],
                          "ratio": {name: m for name, _, _, m, _, _ in table},
                          "ratio_range": {name: [lo, hi] for name, _, _, _, lo, hi in table}}))
        return
    print(f"pdmesh backend: {ours['backend']}; {args.rounds} rounds, each llama.cpp then pdmesh")
    print(f"{'tok/s, ' + str(args.threads) + ' threads':<24}{'pdmesh':>10}{'llama.cpp':>12}{'ratio':>8}"
          f"{'rounds':>16}")
    for name, o, r, m, lo, hi in table:
        print(f"{name:<24}{o:>10.1f}{r:>12.1f}{m:>7.2f}x{lo:>9.2f}-{hi:.2f}x")
    print("(tok/s: medians over rounds; ratio: the median of the rounds' ratios, then their range)")
    wb, bw = ours["decode_weight_bytes_per_token"], ours["read_bandwidth_gb_s"]
    decode = table[1]
    for name, tok_s in (("pdmesh", decode[1]), ("llama.cpp", decode[2])):
        gb_s = wb * tok_s / 1e9
        print(f"decode bandwidth {name:<10}{gb_s:>6.2f} GB/s of weights ({wb / 1e6:.1f} MB/token) = "
              f"{100 * gb_s / bw:.0f}% of the measured read bandwidth {bw:.2f} GB/s ({args.threads} threads)")
    print(f"pdmesh peak RSS {ours['peak_rss_bytes'] / 1e6:.1f} MB (model file {ours['model_file_bytes'] / 1e6:.1f} MB"
          f" + KV pool {ours['kv_pool_bytes'] / 1e6:.1f} MB); RSS after load {ours['rss_after_load_bytes'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
