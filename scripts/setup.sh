#!/usr/bin/env bash
# Set-up on a fresh clone: system packages the local sandbox needs, then a virtual environment in .venv
# with the project (editable) and everything its tests, examples and benchmarks use.
set -euo pipefail
cd "$(dirname "$0")/.."

# bubblewrap: the local sandbox's isolation; iproute2: the network-namespace cluster tests;
# docker.io and mmdebstrap: the Docker provider's engine and its base image (built with no registry).
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "warning: missing ${missing[*]}; install them for isolated local sandboxes, the cluster tests" \
      "and the Docker provider's tests (those are skipped without them)" >&2
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0 is pinned first: a CPU build of it lies on the development machines, and the extra's
# looser range then installs nothing more.
.venv/bin/python -m pip install -q "torch==2.13.0"
# ray: the Ray backend's tests run a local multi-node Ray cluster (about 300 MB, 20 s to install).
.venv/bin/python -m pip install -q -e ".[dev,torch,bench,ray,mini-swe-agent,skyrl]"
# verl's adapter is tested against verl itself, installed without its pins (it caps transformers below
# the torch extra's) and with what its tool and agent-loop modules import. Its wheel also ships a
# top-level `tests` package that would shadow this project's tests: those files are removed.
.venv/bin/python -m pip install -q --no-deps "verl==0.9.1"
.venv/bin/python -m pip install -q "ray>=2.41" "tensordict>=0.8,<=0.10,!=0.9.0" omegaconf hydra-core codetiming \
  "cachetools>=5" "uvicorn>=0.30" "fastapi>=0.110"
.venv/bin/python - <<'PY'
import importlib.metadata as md, os, pathlib
dist = md.distribution("verl")
for f in dist.files or []:
    if f.parts[0] == "tests":
        pathlib.Path(dist.locate_file(f)).unlink(missing_ok=True)
top = pathlib.Path(dist.locate_file("tests"))
for folder, _, _ in sorted(os.walk(top), reverse=True):  # the folders left empty, deepest first
    if not os.listdir(folder):
        os.rmdir(folder)
PY
echo "set-up done: .venv is ready"
