"""The official `openai` Python SDK against a real pdmesh mesh's HTTP API.

Run by `integration/tests/openai_sdk.rs`, which starts the mesh (router with --http-listen,
a prefill and a decode node, TLS and API keys) and passes it in the environment:

  OPENAI_BASE_URL, OPENAI_API_KEY, SSL_CERT_FILE   where the API is, the key, the mesh's CA
  PDMESH_MODEL_ID       the model's id
  PDMESH_REFERENCE      a JSON file: [{"prompt": ..., "max_tokens": n, "tokens": [...]}], the
                        tokens `pdmesh run` gives for each prompt greedily
  PDMESH_METRICS        the nodes' metrics addresses (host:port, comma-separated)
  PDMESH_MAX_IN_FLIGHT  the router's --max-in-flight

Each check prints its name; the first failure ends the run with a traceback (exit 1).
"""

import json
import os
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request

import openai

MODEL = os.environ["PDMESH_MODEL_ID"]
# The SDK retries 429 and 5xx by default; these checks want to see each answer.
client = openai.OpenAI(max_retries=0, timeout=120)


def chat(content, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw
    )


def metric_sum(name):
    """The sum of `name` over every node's /metrics."""
    total = 0.0
    for addr in os.environ["PDMESH_METRICS"].split(","):
        body = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
        for line in body.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def blocks_used():
    return metric_sum("pdmesh_decode_kv_blocks_used") + metric_sum("pdmesh_prefill_kv_blocks_used")


def wait_until(what, probe, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if probe():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_models():
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL], ids
    assert client.models.retrieve(MODEL).id == MODEL


def test_greedy_equals_pdmesh_run():
    with open(os.environ["PDMESH_REFERENCE"]) as f:
        reference = json.load(f)
    assert len(reference) == 12, len(reference)
    for i, r in enumerate(reference):
        kw = dict(max_tokens=r["max_tokens"], temperature=0, extra_body={"return_token_ids": True})
        if i % 2 == 0:
            got = chat(r["prompt"], **kw)
            ids = got.choices[0].token_ids
            text = got.choices[0].message.content
        else:
            # Streamed, the ids and the text arrive in pieces.
            ids, text = [], ""
            for c in chat(r["prompt"], stream=True, **kw):
                for ch in c.choices:
                    ids += getattr(ch, "token_ids", None) or []
                    text += ch.delta.content or ""
        assert ids == r["tokens"], (i, r["prompt"], ids, r["tokens"])
        assert text == r["text"], (i, text, r["text"])


def test_chat_whole():
    r = chat("Name a color.", max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    # A part list is the same message as a string.
    parts = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}],
        max_tokens=8,
        temperature=0,
    )
    assert parts.choices[0].message.content == c.message.content


def test_chat_stream_with_usage():
    chunks = list(
        chat(
            "Count to five.",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    # Every chunk but the last has usage null; the last has no choices and the usage.
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10, last
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = chat("Count to five.", max_tokens=10, temperature=0)
    assert text == whole.choices[0].message.content
    # Without include_usage, no usage anywhere.
    assert all(c.usage is None for c in chat("Hi", max_tokens=3, stream=True))


def test_completions():
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage.completion_tokens <= 6
    streamed = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text, (text, r.choices[0].text)
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # A prompt of token ids.
    ids = client.completions.create(
        model=MODEL, prompt=[504, 3575, 282], max_tokens=3, temperature=0
    )
    assert ids.usage.prompt_tokens == 3


def test_logprobs():
    r = chat("Say yes.", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0.0 and len(t.top_logprobs) == 3
        # Greedy takes the most likely token, so it is the first alternative.
        assert t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    # Streamed, the same numbers in pieces.
    streamed = [
        t
        for c in chat("Say yes.", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, stream=True)
        for ch in c.choices
        if ch.logprobs
        for t in ch.logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    legacy = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == legacy.choices[0].text


def test_stop_strings():
    whole = chat("Count from 1 to 10, separated by commas.", max_tokens=40, temperature=0)
    text = whole.choices[0].message.content
    assert "," in text, text
    cut = text.index(",")
    for stop in [",", [",", "zzz"]]:
        r = chat("Count from 1 to 10, separated by commas.", max_tokens=40, temperature=0, stop=stop)
        assert r.choices[0].message.content == text[:cut], (r.choices[0].message.content, text)
        assert r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in chat("Count from 1 to 10, separated by commas.", max_tokens=40, temperature=0, stop=",", stream=True)
        if c.choices
    )
    assert streamed == text[:cut]


def test_seed_reproducible():
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.95)
    a = chat("Tell me a story.", seed=42, **kw).choices[0].message.content
    b = chat("Tell me a story.", seed=42, **kw).choices[0].message.content
    c = chat("Tell me a story.", seed=7, **kw).choices[0].message.content
    assert a == b, (a, b)
    assert a != c, (a, c)


def test_penalties_change_the_output():
    kw = dict(max_tokens=40, temperature=0)
    plain = chat("Repeat the word cat many times.", **kw).choices[0].message.content
    penalised = chat("Repeat the word cat many times.", frequency_penalty=2.0, **kw).choices[0].message.content
    assert plain != penalised, plain
    present = chat("Repeat the word cat many times.", presence_penalty=2.0, **kw).choices[0].message.content
    assert plain != present, plain


def expect(exc, status, fn, param=None):
    try:
        fn()
    except exc as e:
        assert e.status_code == status, (e.status_code, e)
        if param is not None:
            assert e.body.get("param") == param, e.body
            assert param in e.body["message"], e.body
        return e
    raise AssertionError(f"expected {exc.__name__}")


def test_errors():
    bad = openai.BadRequestError
    expect(bad, 400, lambda: chat("x", temperature=5), "temperature")
    expect(bad, 400, lambda: chat("x", top_p=0), "top_p")
    expect(bad, 400, lambda: chat("x", n=2), "n")
    expect(bad, 400, lambda: chat("x", max_tokens=0), "max_tokens")
    expect(bad, 400, lambda: chat("x", max_tokens=10**6), "max_tokens")
    expect(bad, 400, lambda: chat("x", frequency_penalty=3), "frequency_penalty")
    expect(bad, 400, lambda: chat("x", logprobs=True, top_logprobs=50), "top_logprobs")
    expect(bad, 400, lambda: chat("x", extra_body={"max_tokens": "ten"}), "max_tokens")
    expect(
        bad,
        400,
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}]),
        "messages[0].role",
    )
    expect(bad, 400, lambda: client.chat.completions.create(model=MODEL, messages=[]), "messages")
    expect(bad, 400, lambda: client.completions.create(model=MODEL, prompt=[10**9]), "prompt")
    # Unknown fields are ignored.
    assert chat("x", max_tokens=2, extra_body={"not_a_parameter": 1}).choices
    expect(openai.NotFoundError, 404, lambda: client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}]), "model")
    nokey = openai.OpenAI(api_key="not-a-key", max_retries=0)
    expect(openai.AuthenticationError, 401, lambda: nokey.models.list())
    expect(openai.AuthenticationError, 401, lambda: nokey.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}]))
    # Plaintext HTTP on the HTTPS port is told to use https, not dropped.
    plain = os.environ["OPENAI_BASE_URL"].replace("https://", "http://")
    try:
        urllib.request.urlopen(plain + "/models", timeout=10)
        raise AssertionError("plaintext was served")
    except urllib.error.HTTPError as e:
        assert e.code == 400 and b"HTTPS" in e.read(), e
    # A deadline the request cannot meet: 504.
    expect(
        openai.InternalServerError,
        504,
        lambda: chat("Write a long essay.", max_tokens=4000, extra_body={"ignore_eos": True}, extra_headers={"x-request-timeout": "0.5"}),
    )


def test_overload_is_429_with_retry_after():
    limit = int(os.environ["PDMESH_MAX_IN_FLIGHT"])
    streams = [
        chat("Write a long essay.", max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
        for _ in range(limit)
    ]
    try:
        for s in streams:
            next(iter(s))
        e = expect(openai.RateLimitError, 429, lambda: chat("x", max_tokens=2))
        assert int(e.response.headers["retry-after"]) >= 1
        assert e.body["type"] == "rate_limit_error"
    finally:
        for s in streams:
            s.close()
    wait_until("the router takes requests again", lambda: _ok(lambda: chat("x", max_tokens=2)))


def _ok(fn):
    try:
        fn()
        return True
    except openai.RateLimitError:
        return False


def test_cancelled_stream_frees_every_node():
    wait_until("no blocks in use before", lambda: blocks_used() == 0)
    stream = chat("Write a long essay about the sea.", max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(5):
        next(it)
    used = blocks_used()
    assert used > 0, "a running request holds blocks"
    stream.close()
    wait_until("every node's blocks free after the client left", lambda: blocks_used() == 0, timeout=10)
    assert metric_sum("pdmesh_decode_running_sequences") == 0


def test_traceparent_names_the_trace():
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        extra_headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"},
    )
    assert raw.headers["x-trace-id"] == trace, dict(raw.headers)
    assert raw.headers["x-request-id"].startswith("req-")


def after_every_decode_node_left():
    """Run (by name) once the harness stopped the mesh's decode nodes."""
    health = urllib.request.Request(os.environ["OPENAI_BASE_URL"].removesuffix("/v1") + "/health")
    try:
        urllib.request.urlopen(health, timeout=10)
        raise AssertionError("healthy without a decode node")
    except urllib.error.HTTPError as e:
        assert e.code == 503, e.code
    e = expect(openai.InternalServerError, 503, lambda: chat("x", max_tokens=2))
    assert e.body["type"] == "service_unavailable_error", e.body


def main():
    # The named checks, or every test_ one.
    names = sys.argv[1:] or [n for n in globals() if n.startswith("test_")]
    for name in names:
        fn = globals()[name]
        t0 = time.monotonic()
        try:
            fn()
        except Exception:
            traceback.print_exc()
            print(f"FAILED {name}", flush=True)
            sys.exit(1)
        print(f"ok {name} ({time.monotonic() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
