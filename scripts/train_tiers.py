#!/usr/bin/env python3
"""The tier classifier of `auto` (`[tiers] policy = "classifier"`): trained offline on graded
answers, and the quality-cost tables of both routing policies.

  train_tiers.py labels REPORT --seed 2 --per-kind 60 --out tests/data/tier-labels.json
  train_tiers.py train tests/data/tier-labels.json --ladder A,B,C --out deploy/config/tier-classifier.json
  train_tiers.py check tests/data/tier-labels.json deploy/config/tier-classifier.json
  train_tiers.py table REPORT --ladder A,B,C --cost A=135 ... [--classifier FILE]

`labels` keeps, from a `task_set.py score --out` report of a training set (generated with a
seed other than the test set's), whether each model answered each task right, and the seed
that regenerates the tasks' prompts. `train` fits, for every model of the ladder but the last,
a logistic regression of "this model's answer is as good as the last model's" (it is right,
or the last model is wrong too) on binary features of the prompt's words. Plain Python floats
in a fixed order, so training is deterministic: `check` retrains and asserts the committed
file is what the labels give. The features are the router's (`services/router/src/
classifier.rs`), and the file carries sample texts with their scores, which the router
recomputes when it loads the file.

`table` prints accuracy and compute (tokens x the model's cost, e.g. parameters in millions)
on a scored test report for each model alone, the cascade along the ladder at several
log-probability thresholds (each model but the last answers; kept when its mean token
log-probability reaches the threshold), and the classifier at several chance thresholds.
Greedy answers are deterministic, so what `auto` would answer under each policy follows from
each model's own answers.
"""

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import task_set  # noqa: E402

FEATURES = "ascii-words+pairs+len/v1"
EPOCHS = 300
RATE = 0.5
L2 = 1e-3


def features(text: str) -> list[str]:
    """The router's features, sorted: ASCII words lowercased (a digit run is `#`), each word
    and each neighbouring pair once, and `len:K` for K = floor(log2(words + 1))."""
    words, cur, digits = [], "", False
    for c in text:
        letter = c.isascii() and c.isalpha()
        digit = c.isascii() and c.isdigit()
        if cur and (not (letter or digit) or digit != digits):
            words.append("#" if digits else cur)
            cur = ""
        if letter or digit:
            digits = digit
            cur += c.lower()
    if cur:
        words.append("#" if digits else cur)
    f = set(words) | {f"{a} {b}" for a, b in zip(words, words[1:])}
    f.add(f"len:{(len(words) + 1).bit_length() - 1}")
    return sorted(f)


def self_test() -> None:
    """The cases the router's unit test asserts: both sides compute the same features."""
    assert features("What is 17*23? Answer!") == sorted(
        ["what", "is", "#", "answer", "what is", "is #", "# #", "# answer", "len:2"])
    assert features("") == ["len:0"]
    assert features("ab12cd é x") == sorted(
        ["ab", "#", "cd", "x", "ab #", "# cd", "cd x", "len:2"])


def sigmoid(z: float) -> float:
    z = max(-40.0, min(40.0, z))
    return 1.0 / (1.0 + math.exp(-z))


def score(w: dict, fs: list[str]) -> float:
    return sigmoid(w["bias"] + sum(w["weights"].get(f, 0.0) for f in fs))


def fit(xs: list[list[str]], ys: list[int]) -> dict:
    """L2-regularized logistic regression by full-batch gradient descent, in a fixed order."""
    vocab = sorted({f for x in xs for f in x})
    w = {f: 0.0 for f in vocab}
    bias = 0.0
    n = len(xs)
    for _ in range(EPOCHS):
        grad = {f: 0.0 for f in vocab}
        gb = 0.0
        for x, y in zip(xs, ys):
            err = sigmoid(bias + sum(w[f] for f in x)) - y
            gb += err
            for f in x:
                grad[f] += err
        bias -= RATE * gb / n
        for f in vocab:
            w[f] -= RATE * (grad[f] / n + L2 * w[f])
    # Weights too small to matter are dropped: a smaller file, the same choices.
    return {"bias": bias, "weights": {f: v for f, v in w.items() if abs(v) >= 1e-4}}


def train(labels: dict, ladder: list[str]) -> dict:
    tasks = task_set.generate(labels["per_kind"], labels["seed"])
    ok = labels["ok"]
    for m in ladder:
        if m not in ok:
            sys.exit(f"error: the labels have no answers of {m} (they have {sorted(ok)})")
    top = ladder[-1]
    xs = [features(t["prompt"]) for t in tasks]
    models = {}
    for m in ladder[:-1]:
        # As good as the top model's answer: right, or the top model is wrong too.
        ys = [int(ok[m][t["id"]] or not ok[top][t["id"]]) for t in tasks]
        models[m] = fit(xs, ys)
    samples = [tasks[i]["prompt"] for i in range(0, len(tasks), max(1, len(tasks) // 6))]
    checks = [{"text": s, "p": {m: score(w, features(s)) for m, w in models.items()}}
              for s in samples]
    about = {"trained_on": f"task_set.py generate --seed {labels['seed']} --per-kind "
                           f"{labels['per_kind']} ({len(tasks)} tasks)",
             "target": f"the model's answer is as good as {top}'s (right, or {top} is wrong)",
             "ladder": ladder, "epochs": EPOCHS, "rate": RATE, "l2": L2}
    return {"features": FEATURES, "about": about, "models": models, "checks": checks}


def dump(obj: dict) -> str:
    return json.dumps(obj, indent=1, sort_keys=True) + "\n"


def choose(classifier: dict, ladder: list[str], prompt: str, min_p: float) -> int:
    fs = features(prompt)
    for k, m in enumerate(ladder[:-1]):
        if score(classifier["models"][m], fs) >= min_p:
            return k
    return len(ladder) - 1


def cascade(rows: dict, ladder: list[str], task: str, t: float) -> list[str]:
    """The models a cascade at threshold `t` runs for `task`, the last one's answer kept."""
    ran = []
    for m in ladder:
        ran.append(m)
        if m == ladder[-1] or rows[m][task]["confidence"] >= t:
            break
    return ran


def live(name: str, auto: list[dict], predicted: dict[str, str], first: str) -> bool:
    """Compares `auto`'s live answers with the models the offline table predicts, and prints
    TTFT p50/p99 per answering model and for escalated requests. True if all agree."""
    wrong = [(r["id"], r["model"], predicted[r["id"]]) for r in auto
             if r["model"] != predicted[r["id"]]]
    ok = sum(r["ok"] for r in auto)
    print(f"live auto ({name}): {ok}/{len(auto)} right; answered by the predicted model: "
          f"{len(auto) - len(wrong)}/{len(auto)}; TTFT p50/p99 "
          f"{task_set.ttfts([r['ttft'] for r in auto])}")
    for m in sorted({r["model"] for r in auto}):
        sel = [r for r in auto if r["model"] == m]
        print(f"  answered by {m}: {len(sel)}, TTFT p50/p99 "
              f"{task_set.ttfts([r['ttft'] for r in sel])}")
    up = [r["ttft"] for r in auto if r["model"] != first]
    if up and name.startswith("cascade"):
        print(f"  escalated (answered past {first}): {len(up)}, TTFT p50/p99 "
              f"{task_set.ttfts(up)}")
    for i, got, want in wrong:
        print(f"  MISMATCH {i}: answered by {got}, predicted {want}")
    return not wrong


def table(report: dict, ladder: list[str], costs: dict, log_ps: list[float],
          classifier: dict | None, chances: list[float], tasks: dict) -> None:
    rows = {m: {r["id"]: r for r in report[m]["tasks"]} for m in ladder}
    ids = list(rows[ladder[0]])
    tok = lambda r: r["prompt_tokens"] + r["completion_tokens"]  # noqa: E731
    top = ladder[-1]
    top_acc = sum(rows[top][i]["ok"] for i in ids) / len(ids)
    top_compute = sum(tok(rows[top][i]) * costs[top] for i in ids)
    out = []

    def add(name: str, runs: dict[str, list[str]]) -> None:
        """`runs`: per task, the models that ran, the last one's answer kept."""
        acc = sum(rows[runs[i][-1]][i]["ok"] for i in ids) / len(ids)
        compute = sum(tok(rows[m][i]) * costs[m] for i in ids for m in runs[i])
        answered = {m: sum(runs[i][-1] == m for i in ids) for m in ladder}
        shares = "/".join(str(answered[m]) for m in ladder)
        out.append((name, acc, compute, shares))

    for m in ladder:
        add(f"{m} alone", {i: [m] for i in ids})
    for t in log_ps:
        add(f"cascade, mean logprob >= {t:g}", {i: cascade(rows, ladder, i, t) for i in ids})
    if classifier:
        for p in chances:
            add(f"classifier, chance >= {p:g}",
                {i: [ladder[choose(classifier, ladder, tasks[i]["prompt"], p)]] for i in ids})
    print(f"| policy | answered by {' / '.join(ladder)} | accuracy | / {top} | "
          f"compute / {top} |")
    print("|---|---|---|---|---|")
    for name, acc, compute, shares in out:
        print(f"| {name} | {shares} | {acc:.3f} | {acc / top_acc:.3f} | "
              f"{compute / top_compute:.3f} |")


def main() -> None:
    self_test()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lab = sub.add_parser("labels", help="keep a training report's right/wrong per model")
    lab.add_argument("report")
    lab.add_argument("--seed", type=int, required=True)
    lab.add_argument("--per-kind", type=int, required=True)
    lab.add_argument("--out", required=True)
    tr = sub.add_parser("train", help="fit the classifier on the labels")
    tr.add_argument("labels")
    tr.add_argument("--ladder", required=True, help="model ids, cheapest first, comma-separated")
    tr.add_argument("--out", required=True)
    ch = sub.add_parser("check", help="retrain and compare with the committed classifier")
    ch.add_argument("labels")
    ch.add_argument("classifier")
    tb = sub.add_parser("table", help="the quality-cost table of both policies")
    tb.add_argument("report", help="a `task_set.py score --out` report of the test set")
    tb.add_argument("--tasks", default="tests/data/tasks.jsonl")
    tb.add_argument("--ladder", required=True)
    tb.add_argument("--cost", action="append", default=[], metavar="MODEL=C")
    tb.add_argument("--classifier")
    tb.add_argument("--log-ps", default="-0.1,-0.2,-0.3,-0.5,-0.8")
    tb.add_argument("--chances", default="0.3,0.4,0.5,0.6,0.7,0.8")
    tb.add_argument("--live-classifier", type=float, metavar="P",
                    help="the report's `auto` ran the classifier at chance P: check it")
    tb.add_argument("--live-cascade", metavar="REPORT=T",
                    help="REPORT's `auto` ran the cascade at threshold T: check it")
    a = p.parse_args()
    if a.cmd == "labels":
        report = json.load(open(a.report))
        tasks = task_set.generate(a.per_kind, a.seed)
        ids = [t["id"] for t in tasks]
        ok = {}
        for m, r in report.items():
            got = {row["id"]: bool(row["ok"]) for row in r["tasks"]}
            if sorted(got) != sorted(ids):
                sys.exit(f"error: {m}'s answers are not those of --seed {a.seed} --per-kind "
                         f"{a.per_kind}")
            ok[m] = got
        labels = {"seed": a.seed, "per_kind": a.per_kind, "ok": ok}
        Path(a.out).write_text(dump(labels))
    elif a.cmd == "train":
        c = train(json.load(open(a.labels)), a.ladder.split(","))
        Path(a.out).write_text(dump(c))
    elif a.cmd == "check":
        committed = json.load(open(a.classifier))
        again = train(json.load(open(a.labels)), committed["about"]["ladder"])
        if dump(again) != dump(committed):
            sys.exit(f"error: {a.classifier} is not what its labels train: rerun "
                     f"`just train-tiers`")
        print(f"ok: {a.classifier} is what {a.labels} trains")
    else:
        ladder = a.ladder.split(",")
        costs = {m: float(c) for m, c in (x.split("=", 1) for x in a.cost)}
        for m in ladder:
            costs.setdefault(m, 1.0)
        tasks = {t["id"]: t for t in map(json.loads, open(a.tasks)) if t}
        report = json.load(open(a.report))
        classifier = json.load(open(a.classifier)) if a.classifier else None
        table(report, ladder, costs, [float(x) for x in a.log_ps.split(",")], classifier,
              [float(x) for x in a.chances.split(",")], tasks)
        rows = {m: {r["id"]: r for r in report[m]["tasks"]} for m in ladder}
        agree = True
        if a.live_classifier is not None:
            p = a.live_classifier
            predicted = {i: ladder[choose(classifier, ladder, tasks[i]["prompt"], p)]
                         for i in tasks}
            agree &= live(f"classifier, chance >= {p:g}", report["auto"]["tasks"], predicted,
                          ladder[0])
        if a.live_cascade:
            path, t = a.live_cascade.rsplit("=", 1)
            auto = json.load(open(path))["auto"]["tasks"]
            predicted = {i: cascade(rows, ladder, i, float(t))[-1] for i in tasks}
            agree &= live(f"cascade, mean logprob >= {t}", auto, predicted, ladder[0])
        if not agree:
            sys.exit("error: live `auto` answered by other models than the table predicts")


if __name__ == "__main__":
    main()
