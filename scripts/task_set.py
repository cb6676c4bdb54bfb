#!/usr/bin/env python3
"""A graded task set for tiered routing: tasks whose answers a program checks, across
difficulty levels, built here with no network and no judge model.

  python3 scripts/task_set.py generate [--per-kind 12] [--seed 1] > tasks.jsonl
  python3 scripts/task_set.py check tasks.jsonl        # every reference passes, a wrong one fails
  python3 scripts/task_set.py score tasks.jsonl --model ID [--model ID ...] [--out FILE]

Kinds (each at levels 1-3, harder with the level):
  arith    arithmetic: sums, products, then multi-step word problems; the answer is a number
  extract  extraction from a generated passage (who/where/when), more distractors per level
  format   format following: a word count, a JSON object with given keys, a list in a form
  code     a short Python function, run against its tests in a subprocess with a time limit

Every task is generated from a seeded random source by the code below: the set, its answers and
its checkers are this file's, under the repository's licence; no outside dataset is used.

`score` asks an OpenAI-compatible endpoint (OPENAI_BASE_URL, OPENAI_API_KEY, SSL_CERT_FILE, as
for the SDK) each task greedily through the official `openai` SDK, with the chat template when
the model has one and as a raw "Question/Answer" prompt when it has none, and reports accuracy
per model, kind and level, with tokens, client-side seconds and time to first token (each
answer is streamed); for `auto`, also per model that answered. `scripts/train_tiers.py` turns
scored reports into the routing policies' quality-cost tables. Code answers run as a Python
subprocess of this machine (time-limited, no input): run it only against models you serve.
"""

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time

NAMES = ["Ada", "Bram", "Chen", "Dara", "Elif", "Femi", "Gita", "Hugo", "Ines", "Jonas", "Kiri",
         "Lars", "Mina", "Noor", "Omar", "Pia", "Quinn", "Rosa", "Sami", "Tove"]
CITIES = ["Lisbon", "Oslo", "Quito", "Hanoi", "Cairo", "Perth", "Lagos", "Turin", "Osaka", "Lima",
          "Riga", "Accra", "Bern", "Dakar", "Kyoto", "Porto"]
JOBS = ["baker", "pilot", "nurse", "painter", "farmer", "teacher", "tailor", "chemist"]
ITEMS = ["apples", "books", "chairs", "lamps", "pens", "boxes", "shirts", "plates"]


# --- generation -----------------------------------------------------------------------------

def arith(r: random.Random, level: int) -> dict:
    if level == 1:
        a, b = r.randint(10, 99), r.randint(10, 99)
        q, ans = f"What is {a} + {b}?", a + b
    elif level == 2:
        a, b = r.randint(101, 999), r.randint(3, 9)
        q, ans = f"What is {a} times {b}?", a * b
    else:
        boxes, per, sold, price = r.randint(3, 12), r.randint(4, 12), r.randint(5, 20), r.randint(2, 9)
        item = r.choice(ITEMS)
        total = boxes * per
        sold = min(sold, total - 1)
        q = (f"A shop has {boxes} boxes with {per} {item} in each. It sells {sold} {item}, "
             f"then sells the rest for {price} dollars each. How many dollars does it get for "
             f"the rest?")
        ans = (total - sold) * price
    return {"prompt": q + " Answer with the number only.", "check": {"number": ans},
            "reference": str(ans), "max_tokens": 16}


def extract(r: random.Random, level: int) -> dict:
    people = r.sample(NAMES, 1 + 2 * level)
    facts = []
    for p in people:
        facts.append((p, r.choice(CITIES), r.randint(1950, 2020), r.choice(JOBS)))
    r.shuffle(facts)
    passage = " ".join(f"{p} worked as a {j} and moved to {c} in {y}." for p, c, y, j in facts)
    p, c, y, j = r.choice(facts)
    if level == 1 or r.random() < 0.5:
        q, ans, check = f"To which city did {p} move?", c, {"word": c}
    else:
        q, ans, check = f"In what year did {p} move to {c}?", str(y), {"number": y}
    return {"prompt": f"{passage}\n\n{q} Answer with one word.", "check": check,
            "reference": ans, "max_tokens": 12}


def fmt(r: random.Random, level: int) -> dict:
    if level == 1:
        n = r.randint(3, 6)
        topic = r.choice(["the sea", "winter", "a city at night", "bread", "a river"])
        return {"prompt": f"Describe {topic} in exactly {n} words. Reply with the words only.",
                "check": {"words": n}, "reference": " ".join(["word"] * n), "max_tokens": 24}
    if level == 2:
        name, city = r.choice(NAMES), r.choice(CITIES)
        return {"prompt": f'Reply with only a JSON object with the keys "name" and "city", '
                          f'for a person named {name} who lives in {city}.',
                "check": {"json": {"name": name, "city": city}},
                "reference": json.dumps({"name": name, "city": city}), "max_tokens": 32}
    items = r.sample(ITEMS, 3)
    return {"prompt": f"List these words in alphabetical order, separated by commas, and "
                      f"nothing else: {', '.join(items)}.",
            "check": {"list": sorted(items)}, "reference": ", ".join(sorted(items)),
            "max_tokens": 24}


CODE = [
    # (level, name, signature, what it does, tests as (args, result), a reference body)
    (1, "add", "a, b", "returns the sum of a and b", [((2, 3), 5), ((-4, 4), 0)], "return a + b"),
    (1, "square", "x", "returns x squared", [((3,), 9), ((-5,), 25)], "return x * x"),
    (1, "is_even", "n", "returns True if n is even, else False", [((4,), True), ((7,), False)],
     "return n % 2 == 0"),
    (2, "count_vowels", "s", "returns how many of the letters a, e, i, o, u are in s "
     "(lowercase)", [(("banana",), 3), (("sky",), 0)], "return sum(c in 'aeiou' for c in s)"),
    (2, "reverse_words", "s", "returns s with its space-separated words in reverse order",
     [(("a b c",), "c b a"), (("hello world",), "world hello")],
     "return ' '.join(s.split()[::-1])"),
    (2, "largest", "xs", "returns the largest number in the non-empty list xs",
     [(([3, 9, 2],), 9), (([-1, -7],), -1)], "return max(xs)"),
    (3, "fib", "n", "returns the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1",
     [((0,), 0), ((10,), 55), ((15,), 610)],
     "a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
    (3, "is_palindrome", "s", "returns True if s reads the same backwards ignoring case and "
     "spaces", [(("Never odd or even",), True), (("abc",), False)],
     "t = s.replace(' ', '').lower()\n    return t == t[::-1]"),
    (3, "dedupe", "xs", "returns the list xs without repeated items, keeping first occurrences "
     "in order", [(([1, 2, 1, 3, 2],), [1, 2, 3]), ((["a", "a"],), ["a"])],
     "seen = []\n    for x in xs:\n        if x not in seen:\n            seen.append(x)\n"
     "    return seen"),
]


def code(r: random.Random, level: int) -> dict:
    lvl, name, sig, what, tests, body = r.choice([c for c in CODE if c[0] == level])
    prompt = (f"Write a Python function `{name}({sig})` that {what}. Reply with the code only, "
              f"no explanation.")
    return {"prompt": prompt, "check": {"code": {"name": name, "tests": tests}},
            "reference": f"def {name}({sig}):\n    {body}\n", "max_tokens": 160}


KINDS = {"arith": arith, "extract": extract, "format": fmt, "code": code}


def generate(per_kind: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    tasks = []
    for kind, make in KINDS.items():
        for i in range(per_kind):
            level = 1 + i % 3
            t = make(r, level)
            tasks.append({"id": f"{kind}-{level}-{i}", "kind": kind, "level": level, **t})
    return tasks


# --- checking -------------------------------------------------------------------------------

def numbers(text: str) -> list[int]:
    return [int(x.replace(",", "")) for x in re.findall(r"-?\d[\d,]*", text)]


def code_block(text: str) -> str:
    """The answer's code: a fenced block if there is one, else the text."""
    m = re.search(r"```(?:python)?\n(.*?)(```|$)", text, re.S)
    return m.group(1) if m else text


def passes(task: dict, answer: str) -> bool:
    c = task["check"]
    a = answer.strip()
    if "number" in c:
        found = numbers(a)
        return bool(found) and found[0] == c["number"]
    if "word" in c:
        first = re.findall(r"[A-Za-z]+", a)
        return bool(first) and first[0].lower() == c["word"].lower()
    if "words" in c:
        return len(re.findall(r"[A-Za-z'-]+", a)) == c["words"] and "\n" not in a
    if "json" in c:
        m = re.search(r"\{.*\}", a, re.S)
        try:
            got = json.loads(m.group(0)) if m else None
        except json.JSONDecodeError:
            return False
        return isinstance(got, dict) and got == c["json"]
    if "list" in c:
        got = [w.strip().strip(".").lower() for w in a.split(",")]
        return got == c["list"]
    if "code" in c:
        return run_code(code_block(a), c["code"]["name"], c["code"]["tests"])
    raise ValueError(f"unknown check {c}")


def run_code(src: str, name: str, tests: list) -> bool:
    """Runs `src` and its tests in a fresh, isolated Python with a time limit; True if all
    pass. Tests come from JSON, so their values are Python literals again by `repr`."""
    asserts = "\n".join(f"assert {name}(*{tuple(args)!r}) == {want!r}" for args, want in tests)
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(f"{src}\n\n{asserts}\n")
        f.flush()
        try:
            r = subprocess.run([sys.executable, "-I", f.name], capture_output=True, timeout=5,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
    return r.returncode == 0


def check(tasks: list[dict]) -> None:
    """Each reference passes its checker and a wrong answer fails it: the checkers can fail."""
    wrong = {"arith": "0", "extract": "Nowhere 0", "format": "no", "code": "def f(): pass"}
    for t in tasks:
        assert passes(t, t["reference"]), f"{t['id']}: its reference fails: {t['reference']!r}"
        assert not passes(t, wrong[t["kind"]]), f"{t['id']}: a wrong answer passes"
    print(f"ok: {len(tasks)} tasks, every reference passes and a wrong answer fails")


# --- scoring --------------------------------------------------------------------------------

def ask(client, model: str, task: dict, raw: bool):
    """The model's greedy answer, streamed: its text, usage, the seconds to its first token and
    to its end, the mean log-probability of its tokens, and the model that answered (for
    `auto`, the one the router kept)."""
    t0 = time.perf_counter()
    common = dict(model=model, max_tokens=task["max_tokens"], temperature=0, stream=True,
                  stream_options={"include_usage": True})
    if raw:
        stream = client.completions.create(
            prompt=f"Question: {task['prompt']}\nAnswer:", stop=["\nQuestion:"], logprobs=0,
            **common)
    else:
        stream = client.chat.completions.create(
            messages=[{"role": "user", "content": task["prompt"]}], logprobs=True, **common)
    text, lps, usage, ttft, answered = "", [], None, None, model
    for chunk in stream:
        answered = chunk.model or answered
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if raw else (c.delta.content or "")
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece
            if c.logprobs is None:
                continue
            if raw:
                lps += c.logprobs.token_logprobs or []
            else:
                lps += [t.logprob for t in c.logprobs.content or []]
    secs = time.perf_counter() - t0
    # The cascade's confidence: the mean log-probability of the answer's tokens.
    confidence = sum(lps) / len(lps) if lps else float("-inf")
    return text, usage, ttft if ttft is not None else secs, secs, confidence, answered


def score(tasks: list[dict], models: list[str], out: str | None) -> None:
    import openai

    client = openai.OpenAI(max_retries=0, timeout=600)
    report = {}
    for model in models:
        raw = False
        rows = []
        for t in tasks:
            try:
                text, usage, ttft, secs, confidence, answered = ask(client, model, t, raw)
            except openai.BadRequestError as e:
                if raw or "chat template" not in str(e):
                    raise
                raw = True  # the model has no chat template: ask it raw from now on
                text, usage, ttft, secs, confidence, answered = ask(client, model, t, raw)
            rows.append({"id": t["id"], "kind": t["kind"], "level": t["level"],
                         "ok": passes(t, text), "answer": text, "confidence": confidence,
                         "model": answered, "prompt_tokens": usage.prompt_tokens,
                         "completion_tokens": usage.completion_tokens, "ttft": ttft,
                         "seconds": secs})
        report[model] = {"mode": "raw" if raw else "chat", "tasks": rows}
        summarize(model, rows, raw)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


def summarize(model: str, rows: list[dict], raw: bool) -> None:
    n = len(rows)
    ok = sum(r["ok"] for r in rows)
    toks = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    print(f"{model} ({'raw' if raw else 'chat'}): {ok}/{n} = {ok / n:.3f}; "
          f"{toks} tokens; {secs:.1f} s; TTFT p50/p99 {ttfts([r['ttft'] for r in rows])}")
    answered = sorted({r["model"] for r in rows})
    if answered != [model]:  # `auto`: who answered, and how fast the client saw a token
        for m in answered:
            sel = [r for r in rows if r["model"] == m]
            print(f"  answered by {m}: {len(sel)}, {sum(r['ok'] for r in sel)} right; TTFT "
                  f"p50/p99 {ttfts([r['ttft'] for r in sel])}")
    for kind in KINDS:
        by_level = []
        for level in (1, 2, 3):
            sel = [r for r in rows if r["kind"] == kind and r["level"] == level]
            if sel:
                by_level.append(f"L{level} {sum(r['ok'] for r in sel)}/{len(sel)}")
        print(f"  {kind:8} {'  '.join(by_level)}")


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ttfts(secs: list[float]) -> str:
    return f"{percentile(secs, 50) * 1000:,.0f} / {percentile(secs, 99) * 1000:,.0f} ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write the task set as JSONL to stdout")
    g.add_argument("--per-kind", type=int, default=12)
    g.add_argument("--seed", type=int, default=1)
    c = sub.add_parser("check", help="check the checkers against the references")
    c.add_argument("file")
    s = sub.add_parser("score", help="score models served at OPENAI_BASE_URL")
    s.add_argument("file")
    s.add_argument("--model", action="append", required=True, help="a served model's id")
    s.add_argument("--out", metavar="FILE", help="every answer, its confidence and cost, as JSON")
    a = p.parse_args()
    if a.cmd == "generate":
        for t in generate(a.per_kind, a.seed):
            print(json.dumps(t))
        return
    tasks = [json.loads(line) for line in open(a.file) if line.strip()]
    if a.cmd == "check":
        check(tasks)
    else:
        score(tasks, a.model, a.out)


if __name__ == "__main__":
    main()
