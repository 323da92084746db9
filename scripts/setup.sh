#!/usr/bin/env bash
# Set-up on a fresh clone: system packages the local sandbox needs, then a virtual environment in .venv
# with the project (editable) and everything its tests, examples and benchmarks use.
set -euo pipefail
cd "$(dirname "$0")/.."

# bubblewrap: the local sandbox's isolation; iproute2: the network-namespace cluster tests.
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "warning: missing ${missing[*]}; install them for isolated local sandboxes and the cluster tests" >&2
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0 is pinned first: a CPU build of it lies on the development machines, and the extra's
# looser range then installs nothing more.
.venv/bin/python -m pip install -q "torch==2.13.0"
# ray: the Ray backend's tests run a local multi-node Ray cluster (about 300 MB, 20 s to install).
.venv/bin/python -m pip install -q -e ".[dev,torch,bench,ray]"
echo "set-up done: .venv is ready"
