#!/usr/bin/env python3
"""A graded task set for tiered routing: tasks whose answers a program checks, across
difficulty levels, built here with no network and no judge model.

  python3 scripts/task_set.py generate [--per-kind 12] [--seed 1] > tasks.jsonl
  python3 scripts/task_set.py check tasks.jsonl        # every reference passes, a wrong one fails
  python3 scripts/task_set.py score tasks.jsonl --model ID [--model ID ...] [--out FILE]
  python3 scripts/task_set.py cascade report.json --small ID --large ID [--cost ID=C ...]

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
per model, kind and level, with tokens and client-side seconds. Code answers run as a Python
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
    """The model's greedy answer, its usage and the seconds it took."""
    t0 = time.perf_counter()
    if raw:
        r = client.completions.create(
            model=model, prompt=f"Question: {task['prompt']}\nAnswer:",
            max_tokens=task["max_tokens"], temperature=0, stop=["\nQuestion:"], logprobs=0)
        text = r.choices[0].text
        lps = r.choices[0].logprobs.token_logprobs if r.choices[0].logprobs else []
    else:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": task["prompt"]}],
            max_tokens=task["max_tokens"], temperature=0, logprobs=True)
        text = r.choices[0].message.content or ""
        content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
        lps = [t.logprob for t in content or []]
    # The cascade's confidence: the mean log-probability of the answer's tokens.
    confidence = sum(lps) / len(lps) if lps else float("-inf")
    return text, r.usage, time.perf_counter() - t0, confidence


def score(tasks: list[dict], models: list[str], out: str | None) -> None:
    import openai

    client = openai.OpenAI(max_retries=0, timeout=600)
    report = {}
    for model in models:
        raw = False
        rows = []
        for t in tasks:
            try:
                text, usage, secs, confidence = ask(client, model, t, raw)
            except openai.BadRequestError as e:
                if raw or "chat template" not in str(e):
                    raise
                raw = True  # the model has no chat template: ask it raw from now on
                text, usage, secs, confidence = ask(client, model, t, raw)
            rows.append({"id": t["id"], "kind": t["kind"], "level": t["level"],
                         "ok": passes(t, text), "answer": text, "confidence": confidence,
                         "prompt_tokens": usage.prompt_tokens,
                         "completion_tokens": usage.completion_tokens, "seconds": secs})
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
          f"{toks} tokens; {secs:.1f} s")
    for kind in KINDS:
        by_level = []
        for level in (1, 2, 3):
            sel = [r for r in rows if r["kind"] == kind and r["level"] == level]
            if sel:
                by_level.append(f"L{level} {sum(r['ok'] for r in sel)}/{len(sel)}")
        print(f"  {kind:8} {'  '.join(by_level)}")


def cascade(report: dict, small: str, large: str, costs: dict, thresholds: list[float]) -> None:
    """The quality-cost table of a two-model cascade from both models' scored answers.

    Greedy answers are deterministic, so what the router's `auto` would keep at a threshold is
    the small model's answer where its confidence reaches it, else the large model's; the
    compute is the small model's run for every task plus the large model's where it escalated.
    Compute is tokens (prompt + completion) x the model's cost (`costs`, e.g. parameters in M)
    and client-side seconds."""
    a = {r["id"]: r for r in report[small]["tasks"]}
    b = {r["id"]: r for r in report[large]["tasks"]}
    ids = list(a)
    tok = lambda r: r["prompt_tokens"] + r["completion_tokens"]  # noqa: E731

    def row(name, chosen, compute, secs):
        acc = sum(chosen) / len(ids)
        return name, acc, compute, secs

    rows = []
    rows.append(row(f"{small} alone", [a[i]["ok"] for i in ids],
                    sum(tok(a[i]) * costs[small] for i in ids), sum(a[i]["seconds"] for i in ids)))
    rows.append(row(f"{large} alone", [b[i]["ok"] for i in ids],
                    sum(tok(b[i]) * costs[large] for i in ids), sum(b[i]["seconds"] for i in ids)))
    for t in thresholds:
        keep = {i: a[i]["confidence"] >= t for i in ids}
        chosen = [a[i]["ok"] if keep[i] else b[i]["ok"] for i in ids]
        compute = sum(tok(a[i]) * costs[small] + (0 if keep[i] else tok(b[i]) * costs[large])
                      for i in ids)
        secs = sum(a[i]["seconds"] + (0 if keep[i] else b[i]["seconds"]) for i in ids)
        name = f"cascade >= {t:g} ({sum(not k for k in keep.values())} escalated)"
        rows.append(row(name, chosen, compute, secs))
    big_acc, big_compute = rows[1][1], rows[1][2]
    print(f"| policy | accuracy | / {large} | compute | / {large} | seconds |")
    print("|---|---|---|---|---|---|")
    for name, acc, compute, secs in rows:
        rel = acc / big_acc if big_acc else float("nan")
        print(f"| {name} | {acc:.3f} | {rel:.3f} | {compute:,.0f} | "
              f"{compute / big_compute:.3f} | {secs:.1f} |")


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
    k = sub.add_parser("cascade", help="a cascade's quality-cost table from `score --out`")
    k.add_argument("report", help="the JSON `score --out` wrote")
    k.add_argument("--small", required=True)
    k.add_argument("--large", required=True)
    k.add_argument("--cost", action="append", default=[], metavar="MODEL=C",
                   help="a model's cost per token (e.g. its parameters in millions)")
    k.add_argument("--thresholds", default="-0.1,-0.2,-0.3,-0.5,-0.8,-1.2")
    a = p.parse_args()
    if a.cmd == "cascade":
        costs = {m: float(c) for m, c in (x.split("=", 1) for x in a.cost)}
        for m in (a.small, a.large):
            costs.setdefault(m, 1.0)
        thresholds = [float(x) for x in a.thresholds.split(",")]
        cascade(json.load(open(a.report)), a.small, a.large, costs, thresholds)
        return
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
