"""The official `openai` Python SDK against a mesh serving two models.

Run by `integration/tests/two_models.rs`, which starts the mesh and passes in the environment:

  OPENAI_BASE_URL, OPENAI_API_KEY, SSL_CERT_FILE   where the API is, the key, the mesh's CA
  PDMESH_EXPECT   JSON: [{"model": id, "prompt": ..., "max_tokens": n, "text": ...}], the
                  text `pdmesh run --raw` gives greedily on that model (end of text ignored);
                  for `auto`, "answers" names the model whose answer it must keep

Exits 1 with a traceback at the first failed check.
"""

import json
import os

import openai

client = openai.OpenAI(max_retries=0, timeout=120)
expect = json.loads(os.environ["PDMESH_EXPECT"])

listed = {m.id for m in client.models.list().data}
for e in expect:
    assert e["model"] in listed, f"{e['model']} not in /v1/models: {listed}"
    assert client.models.retrieve(e["model"]).id == e["model"]

for e in expect:
    r = client.completions.create(
        model=e["model"],
        prompt=e["prompt"],
        max_tokens=e["max_tokens"],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    # `auto` names the model whose answer it kept.
    assert r.model == e.get("answers", e["model"]), (r.model, e)
    assert r.choices[0].text == e["text"], (e["model"], r.choices[0].text, e["text"])
    # Streamed, the same text.
    chunks = client.completions.create(
        model=e["model"],
        prompt=e["prompt"],
        max_tokens=e["max_tokens"],
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == e["text"], (e["model"], text, e["text"])
    print(f"ok: {e['model']} by name, whole and streamed")

try:
    client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    raise AssertionError("an unknown model was served")
except openai.NotFoundError as err:
    assert "no-such-model" in str(err), err
print("ok: an unknown model is 404")
