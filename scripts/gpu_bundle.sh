#!/usr/bin/env bash
# Packs what scripts/gpu_tier.sh runs on a GPU machine without Rust or a network into
# .gpu-bundle/ (`just gpu-bundle`): the release pdmesh and pdmesh-tools and the CUDA test
# binaries (cuda_nvrtc, cuda_backend, cuda_model, mesh_equivalence), stripped; the RDMA
# libraries they link, which a GPU image may lack; and the shapes of SmolLM2 and the 1B model
# (`pdmesh synth-model --shape-only`: vocabulary, tensor names, formats and dims), from which
# the tier seeds the models there. All of it xz-compressed, under the limit of what travels to
# this workplace's lent GPU machine (64 MiB a call, the working tree included).
set -euo pipefail
cd "$(dirname "$0")/.."

bundle=.gpu-bundle
limit_mib=${PDMESH_BUNDLE_LIMIT_MIB:-64}
smollm2=models/SmolLM2-135M-Instruct.Q4_1.gguf
llama1b=models/test/synth-llama3-1b-Q4_K_M.gguf
for m in "$smollm2" "$llama1b"; do
    [ -f "$m" ] || { echo "$m is missing (just fetch-model; just fetch-test-models --only synth-llama3-1b-Q4_K_M)" >&2; exit 1; }
done

cargo build --release --locked -q -p pdmesh-cli -p pdmesh-tools
# The test binaries' paths, from cargo's own record of what it built.
tests=$(cargo test --release --locked --no-run --message-format=json \
    -p pdmesh-kernels --test cuda_backend --test cuda_nvrtc \
    -p pdmesh-engine --test cuda_model \
    -p pdmesh-integration --test mesh_equivalence |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin/deps" "$stage/lib"
strip -o "$stage/bin/pdmesh" target/release/pdmesh
strip -o "$stage/bin/pdmesh-tools" target/release/pdmesh-tools
want="cuda_backend cuda_nvrtc cuda_model mesh_equivalence"
while read -r name exe; do
    strip -o "$stage/bin/deps/$name" "$exe"
    want=${want/$name/}
done <<< "$tests"
[ -z "${want// /}" ] || { echo "cargo built no test binary for:$want" >&2; exit 1; }

# The shared libraries outside the C and C++ runtimes (which every GPU image has, newer).
ldd target/release/pdmesh "$stage"/bin/deps/* | awk '/=> \//{print $3}' | sort -u |
    grep -Ev '/lib(c|m|gcc_s|stdc\+\+|pthread|dl|rt)\.so' | while read -r lib; do
        cp -L "$lib" "$stage/lib/"
    done

target/release/pdmesh-tools synth-model --like "$smollm2" --shape-only --out "$stage/smollm2.shape.gguf"
target/release/pdmesh-tools synth-model --like "$llama1b" --shape-only --out "$stage/llama3-1b.shape.gguf"

rm -rf "$bundle" && mkdir -p "$bundle"
tar -C "$stage" -cf - . | xz -6 -T0 > "$bundle/bundle.tar.xz"
{
    echo "pdmesh $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+changes'), built $(date -u +%FT%TZ) on $(uname -m)"
    (cd "$stage" && find . -type f -printf '%10s %p\n' | sort -k2)
} > "$bundle/manifest.txt"

bundle_bytes=$(du -cb "$bundle" | tail -1 | cut -f1)
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | awk '/total$/{s+=$1} END{print s}')
total_mib=$(( (bundle_bytes + tree_bytes) / 1048576 ))
echo "$bundle: $((bundle_bytes / 1048576)) MiB; with the tracked tree $total_mib MiB (limit $limit_mib)"
cat "$bundle/manifest.txt"
[ "$total_mib" -lt "$limit_mib" ] || { echo "too large to travel: $total_mib MiB" >&2; exit 1; }
