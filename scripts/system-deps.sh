#!/usr/bin/env bash
# Installs the system packages the build needs on Debian/Ubuntu: the rdma-core headers UCX is
# compiled against (libibverbs-dev, librdmacm-dev; headers only — no RDMA hardware is needed,
# UCX then runs over TCP and shared memory), and what the tests drive processes and hosts with:
# iproute2 (`ip netns`, the chaos soak) and procps (`kill`); and gcc's Address and Thread Sanitizer runtimes.
# A no-op when they are present.
set -euo pipefail

missing=()
[ -f /usr/include/infiniband/verbs.h ] && [ -f /usr/include/infiniband/mlx5dv.h ] || missing+=(libibverbs-dev)
[ -f /usr/include/rdma/rdma_cma.h ] || missing+=(librdmacm-dev)
command -v make >/dev/null 2>&1 || missing+=(make)
command -v gcc >/dev/null 2>&1 || missing+=(gcc)
# The Address and Thread Sanitizers' runtimes, for the emulated CUDA kernels under them
# (`just test-emu-asan`, `just test-emu-tsan`).
if command -v gcc >/dev/null 2>&1 && { [ ! -f "$(gcc -print-file-name=libasan.so)" ] ||
    [ ! -f "$(gcc -print-file-name=libtsan.so)" ]; }; then
  missing+=("libgcc-$(gcc -dumpversion | cut -d. -f1)-dev")
fi
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
[ -x /bin/kill ] || [ -x /usr/bin/kill ] || missing+=(procps)
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "error: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: install ${missing[*]} (rdma-core headers) with your package manager" >&2
  exit 1
fi
echo "installing ${missing[*]} ..." >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
  $sudo apt-get update -qq
  $sudo apt-get install -y --no-install-recommends "${missing[@]}"
}
