#!/usr/bin/env python3
"""Vocabulary fixtures for the engine's tokenizer tests, with llama.cpp's token ids as the truth.

Writes vocab-only GGUF files to models/test/ (git-ignored: about 20 MiB, rebuilt from sources
any machine has) and models/test/vocab_fixtures.json, which holds what llama.cpp
(llama-cpp-python 0.3.36) gives for each of them: the ids of tests/data/multilingual.txt (whole
and line by line) and of edge strings, and the piece every token id turns into. The Rust test
`services/engine/tests/vocab_fixtures.rs` loads the same GGUFs and must agree exactly.

The vocabularies:
  * spm*.gguf: a SentencePiece BPE model (byte fallback, digits split) trained here on Jules
    Verne's "Around the World in Eighty Days" (public domain), the Project Gutenberg text that
    the `esaxx-rs` crate (a dependency of `tokenizers`) ships as test data; written the way
    llama.cpp's converter writes a Llama 2 / Mistral vocabulary (tokenizer.ggml.model = llama);
  * bpe-<pre>.gguf: SmolLM2's GPT-2 style vocabulary, re-written with each supported
    `tokenizer.ggml.pre`.

Run with the bench venv (`just vocab-fixtures` installs what it needs):
    .bench/venv/bin/python scripts/make_vocab_fixtures.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import gguf
import llama_cpp
import sentencepiece as spm

from verne import verne_path, verne_text

ROOT = Path(__file__).resolve().parent.parent
PINNED = {"gguf": "0.19.0", "sentencepiece": "0.2.3", "llama_cpp": "0.3.36"}

# One `tokenizer.ggml.pre` for each entry (regexes and flags) of `PRE_TOKENIZERS` in
# services/engine/src/tokenizer/bpe.rs, and a few more; None writes no `pre` key at all.
BPE_PRES = [
    None,
    "default",
    "gpt-2",
    "smollm",
    "starcoder",
    "llama-bpe",
    "dbrx",
    "glm4",
    "qwen2",
    "tekken",
    "deepseek-llm",
    "deepseek-coder",
]

SPM_CONTROL = ["<|im_start|>", "<|im_end|>"]
SPM_USER_DEFINED = ["<tool_call>"]

# Strings where tokenizers tend to disagree: empty and whitespace-only text, leading and
# trailing spaces, special tokens inside text, scripts and symbols the SPM model never saw.
EDGE_CASES = [
    "",
    " ",
    "  ",
    "   leading three",
    " a",
    "a ",
    "trailing   ",
    "\n",
    "\n\n\n",
    "\r\n",
    "\t",
    "\t\tx",
    " " * 40,
    "a" * 300,
    "Hello world",
    "😀",
    "😀😃🫠👩‍👩‍👧‍👦",
    "🦀 crab",
    "<s>",
    "</s>",
    "<unk>",
    "<s>Hello</s>",
    "Hello <s> world",
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|><|im_end|>",
    "a<|im_start|>b",
    " <|im_start|> x",
    "<|endoftext|>",
    "<tool_call>{}</tool_call>",
    "I'LL DON'T we'Re they'VE it's",
    "ſ'S 'ſ K'D",
    "İstanbul ǅemal",
    "1234567890",
    "١٢٣٤٥ ²³¼ Ⅻ",
    "e\u0301 é नमस्ते",
    "ꙮ",
    "\u00a0nbsp\u3000ideographic\u2003em",
    "\u200b zero\u200dwidth",
    "\u0085next line",
    "\x00\x01\x7f",
    "tab\tand  double  space",
    "camelCaseWord HTTPServer ÉcoleNormale",
    "x = [1, 2, 3]  # comment\n\tpass",
]


def check_versions() -> None:
    found = {"gguf": _dist_version("gguf"), "sentencepiece": spm.__version__,
             "llama_cpp": llama_cpp.__version__}
    for name, want in PINNED.items():
        if found[name] != want:
            print(f"warning: {name} {found[name]} is installed; the fixtures were made with {want}",
                  file=sys.stderr)


def _dist_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


def train_spm(workdir: Path, source: Path) -> spm.SentencePieceProcessor:
    corpus = workdir / "corpus.txt"
    corpus.write_text(verne_text(source), encoding="utf-8")
    prefix = workdir / "spm"
    # Llama 2's trainer settings where they matter to the tokenizer's shape: BPE, byte fallback,
    # digits split, no normalization, whitespace-only pieces allowed. One thread: reproducible.
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=6000,
        byte_fallback=True,
        split_digits=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        add_dummy_prefix=True,
        control_symbols=SPM_CONTROL,
        user_defined_symbols=SPM_USER_DEFINED,
        num_threads=1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(prefix) + ".model")


def llama_hparams(w: gguf.GGUFWriter) -> None:
    """The few llama hyperparameters llama.cpp reads before it loads a vocabulary."""
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_block_count(1)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(64)


def write_gguf(path: Path, fill) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    llama_hparams(w)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def spm_vocab(sp: spm.SentencePieceProcessor):
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_unknown(i):
            t = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            t = gguf.TokenType.CONTROL
        elif sp.is_unused(i):
            t = gguf.TokenType.UNUSED
        elif sp.is_byte(i):
            t = gguf.TokenType.BYTE
        elif piece in SPM_USER_DEFINED:
            t = gguf.TokenType.USER_DEFINED
        else:
            t = gguf.TokenType.NORMAL
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(t)
    return tokens, scores, types


def smollm_vocab(model: Path):
    """SmolLM2's vocabulary, plus tokens that make pre-tokenizers' differences visible in ids.

    SmolLM2 splits digits and knows no upper-case contractions, so without these a pre-tokenizer
    that grouped digits wrongly (llama3's 1-3 vs qwen2's 1) or took "'LL" for a contraction
    would still give the same ids. The extra merges rank last.
    """
    r = gguf.GGUFReader(str(model))

    def field(key):
        return r.fields[key].contents()

    tokens = list(field("tokenizer.ggml.tokens"))
    types = list(field("tokenizer.ggml.token_type"))
    merges = list(field("tokenizer.ggml.merges"))
    known = set(tokens)

    def add(left: str, right: str) -> None:
        if left + right not in known:
            tokens.append(left + right)
            types.append(int(gguf.TokenType.NORMAL))
            known.add(left + right)
        merges.append(f"{left} {right}")

    digits = "0123456789"
    for a in digits:
        for b in digits:
            add(a, b)
    for a in digits:
        for b in digits:
            for c in digits:
                add(a + b, c)
    for contraction in ["S", "T", "M", "D", "LL", "RE", "VE", "Ll", "Re"]:
        add("'", contraction[0])
        if len(contraction) == 2:
            add("'" + contraction[0], contraction[1])
    # A letter and the combining mark after it: one piece or two depending on whether the
    # pre-tokenizer counts marks as letters (llama.cpp's tekken regex does not).
    add(byte_level(b"\xcc"), byte_level(b"\x81"))
    add("e", byte_level("\u0301".encode()))
    add(byte_level("स".encode()), byte_level("्".encode()))
    add(byte_level("त".encode()), byte_level("े".encode()))
    return tokens, types, merges


def byte_level(data: bytes) -> str:
    """GPT-2's spelling of bytes as printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in data)


@llama_cpp.llama_log_callback
def _quiet(level, text, user_data):
    """llama.cpp's load log is noise here (vocab-only files have no context length …)."""


def llama_ids(model: Path, texts: list[str]) -> tuple[list[list[int]], list[str], list[int]]:
    llm = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    ids = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in texts]
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buf = (llama_cpp.ctypes.c_char * 256)()
    pieces = []
    for tok in range(llm.n_vocab()):
        n = llama_cpp.llama_token_to_piece(vocab, tok, buf, len(buf), 0, True)
        if n < 0:
            raise SystemExit(f"{model}: token {tok}'s piece is longer than {len(buf)} bytes")
        pieces.append(bytes(buf[:n]).hex())
    eog = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    return ids, pieces, eog


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "test")
    ap.add_argument("--bpe-source", type=Path,
                    default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--text", type=Path, default=ROOT / "tests" / "data" / "multilingual.txt")
    ap.add_argument("--corpus", type=Path, default=None,
                    help="esaxx-rs's data/eighty.txt (default: found with cargo metadata)")
    args = ap.parse_args()
    check_versions()
    llama_cpp.llama_log_set(_quiet, None)
    args.out.mkdir(parents=True, exist_ok=True)

    raw = args.text.read_bytes()
    text = raw.decode("utf-8")
    texts = [text] + text.splitlines(keepends=True) + EDGE_CASES

    vocabs = []  # (name, kind, file, writer)
    with tempfile.TemporaryDirectory() as tmp:
        sp = train_spm(Path(tmp), args.corpus or verne_path())
    tokens, scores, types = spm_vocab(sp)

    def spm_writer(add_space_prefix, add_bos, add_eos):
        def fill(w):
            w.add_tokenizer_model("llama")
            w.add_token_list(tokens)
            w.add_token_scores(scores)
            w.add_token_types(types)
            w.add_unk_token_id(sp.unk_id())
            w.add_bos_token_id(sp.bos_id())
            w.add_eos_token_id(sp.eos_id())
            if add_bos is not None:
                w.add_add_bos_token(add_bos)
            if add_eos is not None:
                w.add_add_eos_token(add_eos)
            if add_space_prefix is not None:
                w.add_add_space_prefix(add_space_prefix)
        return fill

    # One with llama.cpp's defaults for SentencePiece (space prefix, BOS, no EOS), and one with
    # each of them turned the other way.
    vocabs.append(("spm", "spm", "spm.gguf", spm_writer(None, None, None)))
    vocabs.append(("spm-noprefix-eos", "spm", "spm-noprefix-eos.gguf",
                   spm_writer(False, False, True)))

    bpe_tokens, bpe_types, merges = smollm_vocab(args.bpe_source)
    for pre in BPE_PRES:
        name = f"bpe-{pre}" if pre else "bpe-nopre"

        def fill(w, pre=pre):
            w.add_tokenizer_model("gpt2")
            if pre is not None:
                w.add_tokenizer_pre(pre)
            w.add_token_list(bpe_tokens)
            w.add_token_types(bpe_types)
            w.add_token_merges(merges)
            w.add_bos_token_id(1)
            w.add_eos_token_id(2)
            # No add_bos_token: each pre-tokenizer's own default is part of what is checked.
        vocabs.append((name, "bpe", f"{name}.gguf", fill))

    out = {
        "generator": "scripts/make_vocab_fixtures.py",
        "llama_cpp_python": llama_cpp.__version__,
        "text_file": str(args.text.relative_to(ROOT)) if args.text.is_relative_to(ROOT)
        else str(args.text),
        "text_sha256": hashlib.sha256(raw).hexdigest(),
        "vocabs": [],
    }
    bpe_pieces_done = False
    for name, kind, file, fill in vocabs:
        path = args.out / file
        write_gguf(path, fill)
        ids, pieces, eog = llama_ids(path, texts)
        entry = {"name": name, "kind": kind, "file": file, "eog": eog,
                 "cases": [{"text": t, "ids": i} for t, i in zip(texts, ids)]}
        # A token's piece does not depend on the pre-tokenizer: once per kind is enough.
        if kind == "spm" or not bpe_pieces_done:
            entry["pieces"] = pieces
            bpe_pieces_done = bpe_pieces_done or kind == "bpe"
        out["vocabs"].append(entry)
        print(f"{file}: {os.path.getsize(path) / 1e6:.1f} MB, {len(ids[0])} tokens for the text")

    (args.out / "vocab_fixtures.json").write_text(
        json.dumps(out, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'vocab_fixtures.json'}")


if __name__ == "__main__":
    main()
