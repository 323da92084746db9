"""Docker images on this host's engine, built with the ``docker`` SDK and no registry: the Docker twin
of :mod:`tangram_env.images`, used by the Docker sandbox provider and by the envs that build images.

Tangram image names map to Docker images (:func:`docker_image_for`): a name given in ``images`` maps
as told, a name with a ``/`` or ``:`` is a Docker reference already (the official SWE-bench images),
and any other name ``N`` is ``tangram/N:latest``. :func:`build_from_context` builds one from a
Dockerfile and files, never pulling and with no network unless asked.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

from tangram_env.images import ImageError
from tangram_env.sandbox import SandboxUnavailable


def docker_image_for(image: str, images: dict[str, str] | None = None) -> str:
    """The Docker image a Tangram image name maps to (see the module's description)."""
    if images and image in images:
        return images[image]
    if "/" in image or ":" in image:
        return image
    return f"tangram/{image.lower()}:latest"


def docker_sdk() -> Any:
    """The ``docker`` SDK's module (:class:`SandboxUnavailable` naming the fix if it is not installed)."""
    try:
        import docker
        import docker.utils.socket
    except ImportError as exc:
        raise SandboxUnavailable(
            "the Docker provider needs the docker SDK: pip install 'tangram-env[docker]' "
            "(or pip install docker)"
        ) from exc
    return docker


def engine_client(client: Any = None) -> Any:
    """``client``, else a client of this host's engine (``$DOCKER_HOST`` or the local socket), checked
    to answer (:class:`ImageError` naming the fix if it does not).
    """
    docker = docker_sdk()
    try:
        made = client or docker.from_env()
        made.ping()
    except docker.errors.DockerException as exc:
        raise ImageError(
            f"no Docker engine answers here ({exc}); start `dockerd` or set DOCKER_HOST"
        ) from exc
    return made


def build_from_context(
    tag: str,
    dockerfile: str,
    files: dict[str, str | os.PathLike[str] | bytes],
    *,
    client: Any = None,
    network: bool = False,
    cache: bool = True,
) -> str:
    """Build ``tag`` from ``dockerfile`` with ``files`` in its context (name: a host directory or file,
    or bytes), never pulling, with no network unless ``network``, reusing the engine's cached layers
    if ``cache``; returns ``tag``.
    """
    client = engine_client(client)
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for arcname, source in {**files, "Dockerfile": dockerfile.encode()}.items():
            if isinstance(source, bytes):
                info = tarfile.TarInfo(arcname)
                info.size, info.mode = len(source), 0o644
                tar.addfile(info, io.BytesIO(source))
            else:
                path = Path(source)
                if not path.exists():
                    raise ImageError(f"{path} (for {tag}) does not exist")
                tar.add(str(path), arcname=arcname)
    context.seek(0)
    docker = docker_sdk()
    try:
        client.images.build(
            fileobj=context,
            custom_context=True,
            tag=tag,
            pull=False,
            rm=True,
            forcerm=True,
            nocache=not cache,
            network_mode=None if network else "none",
        )
    except docker.errors.BuildError as exc:
        steps = "\n".join(str(e.get("stream") or e.get("error") or "").rstrip() for e in exc.build_log)
        raise ImageError(f"docker build of {tag} failed: {exc}\n{steps[-3000:]}") from exc
    except docker.errors.DockerException as exc:
        raise ImageError(f"docker build of {tag} failed: {exc}") from exc
    return tag
