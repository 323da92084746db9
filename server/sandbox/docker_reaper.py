"""Removes a Docker provider's containers once the process that made them is gone, however it ended.

A :class:`~tangram_env.server.sandbox.docker.DockerProvider` starts this process, in a session of its
own, with the read end of a pipe as its standard input, and keeps the write end. The pipe reads as
ended when every holder of the write end has exited, SIGKILL included; this process then removes every
container labelled with the provider's owner. Without it, a killed server's containers ran (holding
their memory and whatever their commands left) until another server started on the host and swept
them.

Usage (the provider's own): ``python -m tangram_env.server.sandbox.docker_reaper OWNER [BASE_URL]``.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Wait for the end of standard input, then remove the containers of ``OWNER``."""
    args = sys.argv[1:] if argv is None else argv
    owner, base_url = args[0], (args[1] if len(args) > 1 and args[1] else None)
    while sys.stdin.buffer.read(4096):  # nothing is ever written: this waits for the end
        pass
    from tangram_env.docker_build import docker_sdk
    from tangram_env.server.sandbox.docker import LABEL, OWNER_LABEL

    docker = docker_sdk()
    client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
    mine = {"label": [LABEL, f"{OWNER_LABEL}={owner}"]}
    for container in client.api.containers(all=True, filters=mine):  # no inspection of each: see sweep
        try:
            client.api.remove_container(container["Id"], force=True)
        except docker.errors.DockerException:  # removed meanwhile
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
