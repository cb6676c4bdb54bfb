#!/usr/bin/env python3
"""Fidelity of pdmesh against llama.cpp on the same GGUF.

1. Tokenization: the rendered chat prompts and the perplexity text must tokenize identically.
2. Greedy generation: 12 varied chat prompts, 48 tokens each. Reports how many match token for
   token; for any that differ, the logit gap between the two candidates at the first divergence,
   as each engine saw it (a near-tie when small).
3. Prompt logits: every position of the first --ctx tokens of --text, all 49152 logits each,
   compared bit for bit.
4. Perplexity over non-overlapping windows of --ctx tokens, every token of a window scored
   except its first, computed the same way for both.

Needs llama-cpp-python (``just compare-llamacpp`` installs it into .bench/venv).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
from llama_cpp import Llama

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning' into Spanish, French and German.",
    "What is 17 times 23?",
    "Give me three tips for sleeping better.",
    "Write a Python function that reverses a string.",
    "Who wrote Pride and Prejudice?",
    "Describe the color blue to someone who cannot see.",
    "List the planets of the solar system in order.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
]


def run_pdmesh(args, extra):
    cmd = [args.pdmesh] + extra + ["--model", args.model, "--threads", str(args.threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"pdmesh failed: {' '.join(cmd[:3])}...\n{r.stderr}")
    return r.stdout


def llama_greedy(llm, tokens, n):
    """Greedy generation that also returns each step's top-2 logits."""
    llm.reset()
    llm.eval(tokens)
    out, tops = [], []
    eog = {llm.token_eos()} | {t for t in range(llm.n_vocab()) if llm.detokenize([t], special=True) in (b"<|im_end|>", b"<|endoftext|>")}
    for _ in range(n):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        order = np.argsort(-logits, kind="stable")[:2]
        tok = int(order[0])
        tops.append([(int(t), float(logits[t])) for t in order])
        if tok in eog:
            break
        out.append(tok)
        llm.eval([tok])
    return out, tops


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--pdmesh", default="target/release/pdmesh")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="perplexity text")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--skip-perplexity", action="store_true")
    args = ap.parse_args()

    llm = Llama(model_path=args.model, n_ctx=2048, n_batch=512, n_threads=args.threads, verbose=False, logits_all=True)
    template = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
    same = 0
    report = []
    for p in PROMPTS:
        text = template.format(p)
        ref_prompt = llm.tokenize(text.encode(), add_bos=False, special=True)
        ref, ref_tops = llama_greedy(llm, ref_prompt, args.tokens)
        ours_json = json.loads(run_pdmesh(args, ["run", "--prompt", p, "--max-tokens", str(args.tokens),
                                                 "--json", "--top-logits", "2"]))
        ours = ours_json["token_ids"]
        if ours_json["prompt_tokens"] != len(ref_prompt):
            print(f"  ! prompt tokenized to {ours_json['prompt_tokens']} tokens, llama.cpp {len(ref_prompt)}")
        if ours == ref:
            same += 1
            report.append(f"  same  {len(ours):>2} tokens  {p!r}")
            continue
        k = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
        ot = ours_json["top_logits"][k] if k < len(ours_json["top_logits"]) else []
        rt = ref_tops[k] if k < len(ref_tops) else []
        gap_o = ot[0][1] - ot[1][1] if len(ot) == 2 else float("nan")
        gap_r = rt[0][1] - rt[1][1] if len(rt) == 2 else float("nan")
        report.append(f"  DIFF  at token {k:>2}: pdmesh top2 {[(t, round(v, 3)) for t, v in ot]} (gap {gap_o:.3f}),"
                      f" llama.cpp top2 {[(t, round(v, 3)) for t, v in rt]} (gap {gap_r:.3f})  {p!r}")
    print(f"greedy generation, {args.tokens} tokens: {same}/{len(PROMPTS)} prompts identical")
    print("\n".join(report))

    text = open(args.text, encoding="utf-8").read()
    toks = llm.tokenize(text.encode(), add_bos=False, special=False)
    win = toks[:args.ctx]
    llm.reset()
    llm.eval(win)
    ref_logits = np.array(llm.scores[:len(win)], dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "logits.f32")
        run_pdmesh(args, ["dump-logits", "--tokens", ",".join(map(str, win)), "--out", out_path])
        ours_logits = np.fromfile(out_path, dtype=np.float32).reshape(len(win), -1)
    same = np.array_equal(ours_logits.view(np.uint32), ref_logits.view(np.uint32))
    diff = float(np.abs(ours_logits - ref_logits).max())
    print(f"prompt logits ({len(win)} positions x {ref_logits.shape[1]}): "
          f"{'bit-identical' if same else 'DIFFERENT'}, max |diff| {diff:.3g}, "
          f"argmax agreement {np.mean(ours_logits.argmax(1) == ref_logits.argmax(1)):.4f}")

    if args.skip_perplexity:
        return
    n_win = len(toks) // args.ctx
    nll, count = 0.0, 0
    for w in range(n_win):
        win = toks[w * args.ctx:(w + 1) * args.ctx]
        llm.reset()
        llm.eval(win)
        logits = np.array(llm.scores[:len(win)], dtype=np.float64)
        mx = logits.max(1, keepdims=True)
        lse = np.log(np.exp(logits - mx).sum(1)) + mx[:, 0]
        nll += float((lse[:-1] - logits[np.arange(len(win) - 1), win[1:]]).sum())
        count += len(win) - 1
    ref_ppl = math.exp(nll / count)
    out = run_pdmesh(args, ["perplexity", "--file", args.text, "--ctx", str(args.ctx)])
    ours_ppl = float(out.strip().splitlines()[-1].split(":")[1])
    print(f"perplexity ({args.text}, {count} tokens scored, ctx {args.ctx}): pdmesh {ours_ppl:.4f}, "
          f"llama.cpp {ref_ppl:.4f}, difference {100 * (ours_ppl / ref_ppl - 1):+.3f}%")


if __name__ == "__main__":
    main()
