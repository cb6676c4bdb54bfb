#!/usr/bin/env python3
"""What moving a stream costs, in one run: a request whose context reaches --context tokens
(1,024: a prompt of about context - max_tokens, then max_tokens out) runs on decode node A of a
mesh of real processes (router, 1 prefill node, decode nodes A and B, each one thread), and
once --at tokens have streamed, A is

- killed (`kill -9`): the router moves the stream to B by recomputing it (the prompt prefilled
  again on the prefill node, its prefix cache helping; each generated token's KV recomputed in
  a decode step on B, as it was first computed), or
- stopped (SIGTERM): A drains, handing the request to B with its KV (UCX or gRPC), nothing
  recomputed.

The cost is the stall the client sees: the longest gap between two deltas after the event,
against the median gap before it (the inter-token latency) in the same stream. Medians over
--rounds rounds per mode, alternating. Both must give the same text as an undisturbed run.
Writes the raw numbers to .bench/migrate.json.
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

BIN = "target/release/pdmesh"
PARAGRAPH = ("The harbour town woke slowly under a grey sky, fishermen hauling nets while the "
             "baker opened his shutters and children ran along the sea wall toward the old "
             "lighthouse, whose keeper had kept a careful log of every ship for forty years. ")


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args):
    """A service; returns it once it printed where it listens."""
    p = subprocess.Popen([BIN] + args + ["--insecure"], stdout=subprocess.PIPE, stderr=sys.stderr,
                         text=True, env=dict(os.environ, PDMESH_LOG="warn"))
    line = p.stdout.readline()
    if "listening on" not in line:
        p.kill()
        raise SystemExit(f"{args[0]} did not start: {line!r}")
    return p


def cpu_ticks(p):
    with open(f"/proc/{p.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class Mesh:
    def __init__(self, a):
        self.api, internal = f"127.0.0.1:{port()}", f"127.0.0.1:{port()}"
        common = ["--model", a.model]
        node = common + ["--router", internal, "--threads", "1", "--kv-transport", a.kv_transport]
        self.procs = [start(["router", "--listen", self.api, "--internal-listen", internal,
                             "--allow-anonymous"] + common)]
        self.procs.append(start(["prefill", "--listen", "127.0.0.1:0", "--node-id", "prefill-0"] + node))
        self.decodes = [start(["decode", "--listen", "127.0.0.1:0", "--node-id", f"decode-{i}"] + node)
                        for i in range(2)]
        time.sleep(1.5)  # registrations and a heartbeat

    def close(self):
        for p in self.procs + self.decodes:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()


def generate(a, mesh, prompt, max_tokens, json_out=False):
    cmd = [BIN, "generate", "--insecure", "--target", mesh.api, "--raw", prompt, "--max-tokens",
           str(max_tokens), "--ignore-eos"] + (["--json"] if json_out else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, bufsize=0)


def prompt_tokens(a, mesh, prompt):
    out = generate(a, mesh, prompt, 1, json_out=True).communicate()[0]
    return json.loads(out)["usage"]["prompt_tokens"]


def stream(a, mesh, prompt, event):
    """Streams a request; after --at deltas applies `event` to the decode node serving it.
    Returns (arrival times, text, index of the first delta after the event)."""
    g = generate(a, mesh, prompt, a.max_tokens)
    times, chunks, after = [], [], [None]

    def read():
        while True:
            b = g.stdout.read(4096)
            if not b:
                return
            times.append(time.perf_counter())
            chunks.append(b)

    t = threading.Thread(target=read)
    t.start()
    while len(times) < a.at and g.poll() is None:
        time.sleep(0.002)
    if event:
        # The node burning CPU now is the one decoding it.
        before = [cpu_ticks(d) for d in mesh.decodes]
        time.sleep(0.3)
        busy = max(range(2), key=lambda i: cpu_ticks(mesh.decodes[i]) - before[i])
        after[0] = len(times)
        mesh.decodes[busy].send_signal(signal.SIGKILL if event == "kill" else signal.SIGTERM)
    t.join()
    g.wait()
    return times, b"".join(chunks).decode(errors="replace"), after[0]


def main():
    global BIN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--at", type=int, default=24, help="deltas streamed before the event")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-transport", default="auto")
    ap.add_argument("--pdmesh", default=BIN)
    a = ap.parse_args()
    BIN = a.pdmesh
    report = {"kill": [], "drain": []}
    mesh = Mesh(a)
    try:
        # The longest prompt of whole paragraphs that leaves room for max_tokens.
        n, per = 1, prompt_tokens(a, mesh, PARAGRAPH)
        n = max(1, (a.context - a.max_tokens) // per)
        prompt = PARAGRAPH * n
        while prompt_tokens(a, mesh, prompt) + a.max_tokens > a.context:
            n -= 1
            prompt = PARAGRAPH * n
        report["prompt_tokens"] = prompt_tokens(a, mesh, prompt)
        _, want, _ = stream(a, mesh, prompt, None)
    finally:
        mesh.close()
    print(f"context {report['prompt_tokens']} + {a.max_tokens} tokens; event after {a.at} deltas; "
          f"{a.rounds} rounds per mode", file=sys.stderr)
    for r in range(a.rounds):
        for mode in (("kill", "drain") if r % 2 == 0 else ("drain", "kill")):
            mesh = Mesh(a)
            try:
                times, text, at = stream(a, mesh, prompt, mode)
            finally:
                mesh.close()
            gaps = [(b - x) * 1e3 for x, b in zip(times, times[1:])]
            itl = statistics.median(gaps[: at - 1])
            stall = max(gaps[at - 1:])
            report[mode].append({"itl_ms": itl, "stall_ms": stall, "same_text": text == want})
            print(f"  {mode:5} itl {itl:6.1f} ms  stall {stall:7.1f} ms  same text: {text == want}",
                  file=sys.stderr)
    print(f"\n== moving a stream at a {a.context}-token context (medians of {a.rounds}) ==")
    print(f"{'how':24} {'ITL ms':>8} {'stall ms':>9} {'extra ms':>9} {'stall/ITL':>10} same text")
    for mode, name in (("kill", "kill -9 (recompute)"), ("drain", "SIGTERM (KV hand-off)")):
        rs = report[mode]
        itl = statistics.median(r["itl_ms"] for r in rs)
        stall = statistics.median(r["stall_ms"] for r in rs)
        same = all(r["same_text"] for r in rs)
        print(f"{name:24} {itl:8.1f} {stall:9.1f} {stall - itl:9.1f} {stall / itl:10.1f} {same}")
    os.makedirs(".bench", exist_ok=True)
    with open(".bench/migrate.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
