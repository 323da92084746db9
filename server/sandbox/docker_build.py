"""Building Docker images for the Docker provider without any registry.

``default`` is a minimal Debian root file system with Python, git and patch, made by ``mmdebstrap``
and imported with ``docker import`` (the engine never pulls). Any other image is built on top of it: the
directory ``from_dir`` becomes its ``/workspace`` and ``env`` its environment. Both end up as
``tangram/NAME:latest``, the name :func:`~tangram_env.docker_build.docker_image_for` maps
the Tangram image ``NAME`` to.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tangram_env.docker_build import build_from_context, docker_image_for, docker_sdk, engine_client
from tangram_env.images import DEFAULT_IMAGE, BuildProgress, ImageError, _Quiet, check_name
from tangram_env.server.sandbox.docker import WORKSPACE

#: Debian release of the base image, and the packages it holds beyond ``minbase`` (git and patch:
#: SWE-bench grading applies patches and restores test files with them).
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "git", "patch")
#: Where the host keeps its Debian sources (deb822), handed to mmdebstrap when present.
DEBIAN_SOURCES = "/etc/apt/sources.list.d/debian.sources"
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def image_exists(name: str, client: Any = None) -> bool:
    """Whether the Docker image of Tangram image ``name`` is on the engine."""
    docker = docker_sdk()
    try:
        engine_client(client).images.get(docker_image_for(name))
    except docker.errors.ImageNotFound:
        return False
    return True


def build_base_image(client: Any = None, progress: BuildProgress | None = None) -> str:
    """Make ``tangram/default:latest`` from a fresh Debian root file system; its Docker name."""
    progress = progress or _Quiet()
    client = engine_client(client)
    if shutil.which("mmdebstrap") is None:
        raise ImageError("building the base image needs mmdebstrap: apt-get install mmdebstrap")
    target = docker_image_for(DEFAULT_IMAGE)
    with tempfile.TemporaryDirectory(prefix="tangram-rootfs-") as tmp:
        tar_path = os.path.join(tmp, "rootfs.tar")
        cmd = ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, tar_path]
        progress.stage(f"debootstrapping Debian {SUITE} with {', '.join(BASE_PACKAGES)}", None)
        if os.path.exists(DEBIAN_SOURCES):
            with open(DEBIAN_SOURCES, "rb") as sources:
                run = subprocess.run(cmd, stdin=sources, capture_output=True, check=False)
        else:  # no deb822 sources here (not a Debian host): Debian's own mirror
            cmd.append(DEBIAN_MIRROR)
            run = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, check=False)
        if run.returncode != 0:
            tail = "\n".join(run.stderr.decode(errors="replace").strip().splitlines()[-8:])
            raise ImageError(f"mmdebstrap failed (exit {run.returncode}):\n{tail}")
        progress.stage(f"importing it as {target}", None)
        repository, _, tag = target.rpartition(":")
        client.api.import_image_from_file(tar_path, repository=repository, tag=tag)
    return target


def build_docker_image(
    name: str = DEFAULT_IMAGE,
    *,
    from_dir: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    client: Any = None,
    progress: BuildProgress | None = None,
) -> str:
    """Build the Docker image of Tangram image ``name`` (see the module's description); its Docker name.

    ``default`` is (re)built from Debian; another name needs ``default`` built first and starts from
    it, with ``from_dir`` copied into its workspace.
    """
    check_name(name)
    progress = progress or _Quiet()
    client = engine_client(client)
    if name == DEFAULT_IMAGE:
        if from_dir or env:
            raise ImageError("the default image is plain Debian with Python: build another name from it")
        return build_base_image(client, progress)
    if not image_exists(DEFAULT_IMAGE, client):
        raise ImageError(
            "the base image is missing: run `tangram-server image build --docker` (default) first"
        )
    lines = [f"FROM {docker_image_for(DEFAULT_IMAGE)}"]
    lines += [f"ENV {key}={json.dumps(value)}" for key, value in sorted((env or {}).items())]
    files: dict[str, str | os.PathLike[str] | bytes] = {}
    if from_dir is not None:
        if not Path(from_dir).is_dir():
            raise ImageError(f"--from {from_dir} is not a directory")
        files["workspace"] = from_dir
        lines.append(f"COPY workspace/ {WORKSPACE}/")
    lines.append(f"WORKDIR {WORKSPACE}")
    target = docker_image_for(name)
    progress.stage(f"building {target} from the base image", None)
    return build_from_context(target, "\n".join(lines) + "\n", files, client=client)
