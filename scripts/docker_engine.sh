#!/usr/bin/env bash
# A Docker engine for the Docker provider: start `dockerd` in the background unless one answers, then
# build the base image tangram/default (Debian with Python, git and patch, from mmdebstrap; no
# registry) unless it is there already. Exits non-zero, changing nothing else, where that cannot be
# done (not root, no dockerd).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! docker info >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] || ! command -v dockerd >/dev/null 2>&1; then
    echo "no Docker engine, and none can be started here (needs root and dockerd)" >&2
    exit 1
  fi
  log=${TMPDIR:-/tmp}/tangram-dockerd.log
  echo "starting dockerd in the background (log: $log)"
  nohup dockerd >"$log" 2>&1 &
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start; see $log" >&2; exit 1; }
fi
# The base image holds what grading needs (git, patch) since the swe-bench set runs under Docker: an
# older one without them is built again.
if docker run --rm --network none tangram/default:latest sh -c 'command -v git && command -v patch' \
    >/dev/null 2>&1; then
  echo "Docker base image tangram/default is here"
else
  .venv/bin/tangram-server image build --docker
fi
