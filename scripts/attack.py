#!/usr/bin/env python3
"""Each attack on the mesh's front door, against `pdmesh up` while a legitimate client runs.

A mesh of 1 prefill + 1 decode node starts as `pdmesh up` starts it (mutual TLS, API keys).
A legitimate client (`pdmesh bench`, the mesh's operator key, from 127.0.0.1) sends a steady
open-loop load in every phase: once with no attack, then once under each attack below, which
runs from other loopback addresses (127.0.0.2 and up: another host, as the router counts
peers) for the whole phase. Per phase it prints the legitimate client's success rate and p99
time to first token against the no-attack phase, the router's peak resident memory, and the
share of a core the router used.

  slow-handshakes  sockets to the gRPC and HTTPS ports that send one byte of a TLS hello and
                   stall, reopened as the router closes them (--sockets per port)
  slow-bodies      keyed HTTPS POSTs announcing a 1 MB body and sending a byte a second
  stream-flood     HTTP/2 connections to the gRPC port, each with every stream it may open
                   carrying a Generate's headers and a valid key, and never a body
  cancel-flood     Cancel for ids nobody holds, --cancel-rate a second, by a keyed tenant
  stalled-sse      streamed completions by a keyed tenant that never reads them
  multi-key        one tenant with two keys (max_in_flight 2) flooding completions through both
                   alternately: its peak in flight is printed too

The attacker is a tenant of its own (`mallory`, max_in_flight 2) where an attack needs a key.
Absolute times drift on a shared machine; compare within one run. Needs the `h2` package.
"""
import argparse
import asyncio
import json
from collections import Counter
import multiprocessing
import os
import random
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions

BIN = "target/release/pdmesh"
ATTACKS = ["slow-handshakes", "slow-bodies", "stream-flood", "cancel-flood", "stalled-sse", "multi-key"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mesh:
    """`pdmesh up` in a home of its own, so its credentials are this run's."""

    def __init__(self, a):
        self.home = tempfile.mkdtemp(prefix="pdmesh-attack-")
        self.grpc = ("127.0.0.1", free_port())
        self.http = ("127.0.0.1", free_port())
        self.env = dict(os.environ, PDMESH_HOME=self.home, PDMESH_LOG="warn")
        listen = f"{self.grpc[0]}:{self.grpc[1]}"
        cmd = [BIN, "up", "--listen", listen, "--http-listen", f"{self.http[0]}:{self.http[1]}",
               "--model", a.model, "--prefill", "1", "--decode", "1",
               # No prefix cache: every phase sends the same prompts at the same times, and
               # none is served from what an earlier phase left.
               "--kvstore-budget-bytes", "0", "--cache-bytes", "0"]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=self.env)
        line = self.p.stdout.readline()
        if "ready" not in line:
            self.p.kill()
            raise SystemExit(f"mesh did not start: {line!r}")
        self.dir = os.path.join(self.home, "up", listen.replace(":", "_"))
        self.ca = os.path.join(self.dir, "ca.pem")
        self.router = self.child("router")
        self.model = self.served_model()

    def served_model(self):
        """The id the OpenAI API serves the model as (`GET /v1/models`)."""
        with open(os.path.join(self.dir, "api-key")) as f:
            key = f.read().strip()
        ctx = tls(self, ["http/1.1"])
        with socket.create_connection(self.http) as raw, ctx.wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
                      f"Connection: close\r\n\r\n".encode())
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        return json.loads(reply.split(b"\r\n\r\n", 1)[1])["data"][0]["id"]

    def child(self, role):
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if ppid == self.p.pid and len(argv) > 1 and argv[1] == role.encode():
                return int(pid)
        raise SystemExit(f"no {role} process under pdmesh up")

    def cpu_s(self):
        """The router's CPU time so far (user + system)."""
        with open(f"/proc/{self.router}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_kib(self):
        with open(f"/proc/{self.router}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def key(self, tenant, max_in_flight):
        """A new API key for `tenant` (the router reads its key file again within seconds)."""
        out = subprocess.run([BIN, "api-key", "--tenant", tenant, "--file", os.path.join(self.dir, "api-keys.toml"),
                              "--max-in-flight", str(max_in_flight)], check=True, capture_output=True, text=True)
        return out.stdout.strip()

    def stop(self):
        self.p.terminate()
        self.p.wait(timeout=30)


def tls(mesh, alpn):
    c = ssl.create_default_context(cafile=mesh.ca)
    c.set_alpn_protocols(alpn)
    return c


async def connect(mesh, port, src, alpn, rcvbuf=None):
    """A TLS connection to the router from `src`."""
    s = socket.socket()
    s.setblocking(False)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((src, 0))
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
    return await asyncio.wait_for(
        asyncio.open_connection(sock=s, ssl=tls(mesh, alpn), server_hostname="localhost"), 10)


def completion(mesh, key, max_tokens, stream):
    body = json.dumps({"model": mesh.model, "prompt": "Tell me a story about a lighthouse keeper.",
                       "max_tokens": max_tokens, "stream": stream}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


# -- the attacks: each runs until `stop` is set, and returns what it saw -----------------------

async def slow_handshakes(mesh, stop, a, stats):
    async def hold(port):
        while not stop.is_set():
            try:
                s = socket.socket()
                s.setblocking(False)
                s.bind(("127.0.0.2", 0))
                await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
                r, w = await asyncio.open_connection(sock=s)
                w.write(b"\x16")  # a TLS record's first byte, then nothing
                stats["opened"] += 1
                await r.read(1)  # until the router closes it
                w.close()
                # Stalling, not flooding connects: a closed socket is reopened a second later.
                await asyncio.sleep(1.0)
            except OSError:
                stats["refused"] += 1
                await asyncio.sleep(0.05)
    await asyncio.gather(*(hold(p) for p in (mesh.grpc[1], mesh.http[1]) for _ in range(a.sockets)))


async def slow_bodies(mesh, stop, a, stats):
    async def one():
        while not stop.is_set():
            try:
                r, w = await connect(mesh, mesh.http[1], "127.0.0.3", ["http/1.1"])
                w.write((f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                         f"{a.mallory[0]}\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{{").encode())
                while not stop.is_set():
                    await w.drain()
                    w.write(b" ")
                    try:
                        reply = await asyncio.wait_for(r.read(64), 1.0)
                    except asyncio.TimeoutError:
                        continue
                    # The router answered (408 once the body is too slow, 429 past the
                    # tenant's limit) or closed.
                    seen = reply.split(b"\r\n")[0].decode(errors="replace") or "closed"
                    stats[seen] += 1
                    break
                w.close()
                await asyncio.sleep(1.0)  # holding bodies open, not flooding requests
            except (OSError, asyncio.TimeoutError, ssl.SSLError):
                stats["refused"] += 1
                await asyncio.sleep(1.0)
    await asyncio.gather(*(one() for _ in range(a.bodies)))


class H2:
    """One HTTP/2 connection to the gRPC port."""

    async def open(self, mesh, src):
        self.r, self.w = await connect(mesh, mesh.grpc[1], src, ["h2"])
        self.c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.c.initiate_connection()
        self.flush()
        return self

    def flush(self):
        self.w.write(self.c.data_to_send())

    def headers(self, path, key, end=False):
        sid = self.c.get_next_available_stream_id()
        self.c.send_headers(sid, [(":method", "POST"), (":scheme", "https"), (":path", path),
                                  (":authority", "localhost"), ("content-type", "application/grpc"),
                                  ("te", "trailers"), ("authorization", f"Bearer {key}")], end_stream=end)
        return sid

    async def events(self):
        data = await self.r.read(65536)
        if not data:
            raise ConnectionError("closed")
        ev = self.c.receive_data(data)
        self.flush()
        return ev


async def stream_flood(mesh, stop, a, stats):
    async def one():
        while not stop.is_set():
            try:
                h = await H2().open(mesh, "127.0.0.4")
                # The server's SETTINGS say how many streams it allows at once.
                await h.events()
                most = min(h.c.remote_settings.max_concurrent_streams, 1024)
                for _ in range(most):
                    h.headers("/pdmesh.v1.Generation/Generate", a.mallory[0])
                h.flush()
                stats["streams"] += most
                while not stop.is_set():
                    try:
                        evs = await asyncio.wait_for(h.events(), 1.0)
                    except asyncio.TimeoutError:
                        continue
                    count_ends(evs, stats)
                h.w.close()
            except (OSError, ConnectionError, asyncio.TimeoutError, ssl.SSLError, h2.exceptions.ProtocolError):
                stats["closed"] += 1
                await asyncio.sleep(0.2)
    await asyncio.gather(*(one() for _ in range(a.h2_connections)))


def count_ends(events, stats):
    """Counts the gRPC statuses and resets among `events`; returns the streams they ended."""
    ended = []
    for e in events:
        if isinstance(e, h2.events.StreamReset):
            stats["reset"] += 1
            ended.append(e.stream_id)
        elif isinstance(e, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            status = dict(e.headers).get(b"grpc-status")
            if status is not None:
                stats[f"grpc-status {status.decode()}"] += 1
                ended.append(e.stream_id)
    return ended


def grpc_frame(request_id):
    raw = request_id.encode()
    msg = b"\x0a" + bytes([len(raw)]) + raw  # CancelRequest { request_id = 1 }
    return b"\x00" + len(msg).to_bytes(4, "big") + msg


async def cancel_flood(mesh, stop, a, stats):
    h = await H2().open(mesh, "127.0.0.5")
    pending = {}
    gap = 1.0 / a.cancel_rate

    async def send():
        n = 0
        start = time.monotonic()
        while not stop.is_set():
            if len(pending) < 200:
                sid = h.headers("/pdmesh.v1.Generation/Cancel", a.mallory[n % 2])
                h.c.send_data(sid, grpc_frame(f"nobody-{random.getrandbits(64):x}"), end_stream=True)
                h.flush()
                pending[sid] = time.monotonic()
                n += 1
            await asyncio.sleep(max(0.0, start + n * gap - time.monotonic()))

    async def recv():
        while not stop.is_set():
            try:
                evs = await asyncio.wait_for(h.events(), 1.0)
            except asyncio.TimeoutError:
                continue
            for sid in count_ends(evs, stats):
                pending.pop(sid, None)
    await asyncio.gather(send(), recv())


async def stalled_sse(mesh, stop, a, stats):
    async def one(i):
        while not stop.is_set():
            try:
                r, w = await connect(mesh, mesh.http[1], "127.0.0.6", ["http/1.1"], rcvbuf=4096)
                w.write(completion(mesh, a.mallory[i % 2], 2000, True))
                await w.drain()
                line = await asyncio.wait_for(r.readline(), 30)
                seen = line.decode(errors="replace").strip() or "closed"
                stats[seen] += 1
                # Never read again: the socket's small buffer fills and the router's writes
                # stall.
                while not stop.is_set():
                    await asyncio.sleep(0.5)
                w.close()
            except (OSError, asyncio.TimeoutError, ssl.SSLError):
                stats["refused"] += 1
                await asyncio.sleep(0.5)
    await asyncio.gather(*(one(i) for i in range(a.stalled)))


async def multi_key(mesh, stop, a, stats):
    live = [0]

    async def one(i):
        n = i
        while not stop.is_set():
            try:
                r, w = await connect(mesh, mesh.http[1], "127.0.0.7", ["http/1.1"])
                w.write(completion(mesh, a.mallory[n % 2], 16, False))
                n += 1
                status = (await r.readline()).decode(errors="replace").split(" ")[1:2]
                code = status[0] if status else "closed"
                if code == "200":
                    live[0] += 1
                    stats["peak_in_flight"] = max(stats["peak_in_flight"], live[0])
                    await r.read()
                    live[0] -= 1
                stats[code] += 1
                w.close()
                if code != "200":
                    await asyncio.sleep(0.2)
            except (OSError, asyncio.TimeoutError, ssl.SSLError):
                stats["refused"] += 1
                await asyncio.sleep(0.2)
    await asyncio.gather(*(one(i) for i in range(a.flooders)))


RUN = {"slow-handshakes": slow_handshakes, "slow-bodies": slow_bodies, "stream-flood": stream_flood,
       "cancel-flood": cancel_flood, "stalled-sse": stalled_sse, "multi-key": multi_key}


def run_attack(name, mesh, a, stop, out):
    """One attack in a process of its own at the lowest priority: the attacker stands for
    another host, so its own CPU must not be what slows the mesh on a shared machine."""
    os.nice(19)
    stats = Counter()

    async def main():
        ev = asyncio.Event()
        task = asyncio.ensure_future(RUN[name](mesh, ev, a, stats))
        while not stop.is_set() and not task.done():
            await asyncio.sleep(0.1)
        ev.set()
        try:
            await asyncio.wait_for(task, 5)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            task.cancel()
        if task.done() and not task.cancelled() and task.exception():
            raise task.exception()
    try:
        asyncio.run(main())
        out.put((stats, None))
    except Exception as e:  # the table says an attack broke, and why
        out.put((stats, repr(e)))


class Attack:
    def __init__(self, name, mesh, a):
        self.stop, self.out = multiprocessing.Event(), multiprocessing.Queue()
        self.p = multiprocessing.Process(target=run_attack, args=(name, mesh, a, self.stop, self.out), daemon=True)
        self.stats, self.error = {}, None

    def start(self):
        self.p.start()

    def end(self):
        self.stop.set()
        try:
            self.stats, self.error = self.out.get(timeout=20)
        except Exception:
            self.error = "the attack did not report"
        self.p.join(5)
        if self.p.is_alive():
            self.p.kill()


def legit(mesh, a, seed):
    """The legitimate client's load: success rate and p99 TTFT. `seed` fixes its prompts
    and arrival times: every phase but the warm-up sends the same."""
    out = subprocess.run([BIN, "bench", "--json", "--target", f"{mesh.grpc[0]}:{mesh.grpc[1]}",
                          "--rate", str(a.rate), "--requests", str(a.requests), "--prompt-tokens", "128",
                          "--max-tokens", "16", "--seed", str(seed)],
                         capture_output=True, text=True, env=mesh.env, timeout=600)
    if out.returncode != 0:
        return {"requests": a.requests, "ok": 0, "ttft_ms": {"p99": float("nan")}, "errors": [out.stderr[-300:]]}
    return json.loads(out.stdout)["results"]


def phase(mesh, a, name, seed):
    peak = [mesh.rss_kib()]
    cpu0, t0 = mesh.cpu_s(), time.monotonic()
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], mesh.rss_kib())
            time.sleep(0.2)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    attack = None
    if name != "none":
        attack = Attack(name, mesh, a)
        attack.start()
        time.sleep(a.ramp_s)
    r = legit(mesh, a, seed)
    if attack:
        attack.end()
    done.set()
    sampler.join()
    router_cpu = (mesh.cpu_s() - cpu0) / (time.monotonic() - t0)
    time.sleep(2)
    return {"attack": name, "ok": r["ok"], "requests": r["requests"], "ttft_p99_ms": r["ttft_ms"]["p99"],
            "ttft_p50_ms": r["ttft_ms"]["p50"] if "p50" in r["ttft_ms"] else float("nan"),
            "router_peak_rss_mib": peak[0] / 1024, "router_cpu": router_cpu, "errors": r.get("errors", []),
            "attacker_saw": attack.stats if attack else {}, "attack_error": attack.error if attack else None}


def main():
    global BIN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--pdmesh", default=BIN, help="the pdmesh binary")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="which attacks (comma-separated)")
    ap.add_argument("--rate", type=float, default=1.0, help="the legitimate client's requests a second")
    ap.add_argument("--requests", type=int, default=60, help="the legitimate client's requests per phase")
    ap.add_argument("--ramp-s", type=float, default=5.0, help="seconds an attack runs before the client starts")
    ap.add_argument("--sockets", type=int, default=600, help="slow-handshakes: sockets held per port")
    ap.add_argument("--bodies", type=int, default=200, help="slow-bodies: bodies trickling at once")
    ap.add_argument("--h2-connections", type=int, default=32, help="stream-flood: connections")
    ap.add_argument("--cancel-rate", type=float, default=500.0, help="cancel-flood: cancels a second")
    ap.add_argument("--stalled", type=int, default=16, help="stalled-sse: streams never read")
    ap.add_argument("--flooders", type=int, default=16, help="multi-key: requests the tenant keeps sending")
    ap.add_argument("--rss-bound-mib", type=float, default=512.0, help="the router's resident memory bound")
    a = ap.parse_args()
    BIN = a.pdmesh
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    attacks = [x for x in a.attacks.split(",") if x]
    for x in attacks:
        if x not in RUN:
            raise SystemExit(f"unknown attack {x!r}: one of {', '.join(ATTACKS)}")
    mesh = Mesh(a)
    try:
        a.mallory = [mesh.key("mallory", 2), mesh.key("mallory", 2)]
        time.sleep(6)  # the router reads its key file every 5 s
        legit(mesh, argparse.Namespace(**{**vars(a), "requests": 20}), 1000)  # warm-up
        rows = [phase(mesh, a, "none", 1)] + [phase(mesh, a, x, 1) for x in attacks]
        # Once more without an attack: how far the machine itself drifted during the run.
        rows.append(phase(mesh, a, "none", 1))
    finally:
        mesh.stop()
    base = rows[0]
    print(f"\n== attacks on `pdmesh up` (legitimate client: {a.rate}/s, {a.requests} requests per phase) ==")
    print(f"{'attack':<16} {'success':>8} {'p99 TTFT':>10} {'vs none':>8} {'router RSS':>11} {'router CPU':>11}  attacker saw")
    ok = True
    for r in rows:
        rate = r["ok"] / r["requests"]
        ratio = r["ttft_p99_ms"] / base["ttft_p99_ms"]
        ok &= rate >= 0.99 and (r is base or ratio <= 1.5) and r["router_peak_rss_mib"] <= a.rss_bound_mib
        saw = r["attack_error"] or ", ".join(f"{k}: {v}" for k, v in sorted(r["attacker_saw"].items()))
        print(f"{r['attack']:<16} {rate:>8.1%} {r['ttft_p99_ms']:>8.0f}ms {ratio:>7.2f}x {r['router_peak_rss_mib']:>8.0f}MiB {r['router_cpu']:>10.0%}  {saw}")
        for e in r["errors"][:2]:
            print(f"{'':<16} error: {e}")
    print(f"goals: success >= 99%, p99 TTFT <= 1.5x none, router RSS <= {a.rss_bound_mib:.0f} MiB: "
          f"{'met' if ok else 'NOT met'}")
    os.makedirs(".bench", exist_ok=True)
    with open(".bench/attack.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
