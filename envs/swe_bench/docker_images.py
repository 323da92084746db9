"""The offline set as Docker images laid out as SWE-bench's, built on this host with no registry.

Three layers, as SWE-bench's harness builds its own (base, environment, instance):

- **base**: ``tangram/default`` (Debian with Python, git and patch; ``tangram-server image build
  --docker`` makes it from an mmdebstrap root file system);
- **environment**, one per package: ``tangram/sweb.env.<package>-<version>``, a virtual environment at
  SWE-bench's interpreter path (``/opt/miniconda3/envs/testbed``, first on ``PATH``) holding the
  package's requirements, which pip installs in the build from wheels downloaded on the host (the
  build has no network);
- **instance**: the Docker image of the instance's Tangram image (``tangram/swe-bench.<id>``), its
  repository at ``/testbed``, the working directory.

Every image carries a label with a digest of its inputs (its parent image, the requirements, the
repository's commit); an image whose label matches is kept, so a second run builds nothing. A new
instance image is validated in a container of it, as the instance was on the host: the gold patch
resolves it and no change does not (the image's interpreter is not the host's, so an instance
whose tests depend on it would otherwise reward wrongly); one that fails is removed, with the reason.
Validation takes the users' path: the env, on an orchestrator child run with the Docker sandbox
provider (one for the whole run, started on the first image to validate).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tangram_env.docker_build import build_from_context, docker_image_for, engine_client
from tangram_env.envs.swe_bench.generate import PrepareError
from tangram_env.envs.swe_bench.instance import TESTBED, TESTBED_PYTHON, SweBenchInstance
from tangram_env.envs.swe_bench.packages import Package
from tangram_env.envs.swe_bench.progress import Progress
from tangram_env.errors import RewardUnavailable, ServerUnavailable
from tangram_env.launch import ServerProcess

#: The label naming an image's inputs, and the one every image of the set carries (for cleaning up).
INPUTS_LABEL = "tangram.swe-bench.inputs"
SET_LABEL = "tangram.swe-bench"
#: Bumped whenever the images would come out differently.
BUILDER_VERSION = 1
#: SWE-bench's environment prefix (its images make it with conda; here it is a virtual environment).
ENV_PREFIX = TESTBED_PYTHON.removesuffix("/bin/python")
_PATH = f"{ENV_PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: What git needs in the images: who commits, and no pager.
_GITCONFIG = "[user]\n\tname = agent\n\temail = agent@localhost\n[core]\n\tpager = cat\n"


def env_image_name(pkg: Package) -> str:
    """The Tangram name of ``pkg``'s environment image (``tangram/`` + it, in Docker)."""
    return f"sweb.env.{pkg.slug.lower()}-{pkg.version}"


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([BUILDER_VERSION, *parts], default=str).encode()).hexdigest()[:16]


def _docker() -> tuple[Any, Any]:
    """The docker SDK's module and a client of this host's engine (or :class:`PrepareError`)."""
    try:
        import docker
    except ImportError:
        raise PrepareError(
            "building Docker images needs the docker SDK: pip install 'tangram-env[docker]'"
        ) from None
    try:
        return docker, engine_client()
    except Exception as exc:
        raise PrepareError(str(exc)) from exc


def _labels_of(client: Any, docker: Any, tag: str) -> dict[str, str] | None:
    """The labels of image ``tag`` (None if it is not on the engine)."""
    try:
        return dict(client.images.get(tag).labels or {})
    except docker.errors.ImageNotFound:
        return None


def _base_python(client: Any, base: str) -> str:
    """``X.Y`` of the base image's Python (the wheels downloaded must fit it)."""
    out = client.containers.run(
        base,
        ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        remove=True,
        network_mode="none",
    )
    return bytes(out).decode().strip()


def _download_wheels(pkg: Package, python: str, dest: Path) -> None:
    """Wheels of pip and ``pkg``'s requirements for Python ``python``, downloaded once into ``dest``."""
    if (dest / ".complete").exists():
        return
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "--python-version",
        python,
        "-d",
        str(dest),
        "pip",
        *pkg.requirements,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PrepareError(
            f"downloading the wheels of {pkg.requirement}'s environment failed: {done.stderr.strip()[-2000:]}"
        )
    (dest / ".complete").write_text(" ".join(pkg.requirements))


def _env_dockerfile(base: str, pkg: Package, labels: dict[str, str]) -> str:
    reqs = " ".join(json.dumps(r) for r in pkg.requirements)
    return "\n".join(
        [
            f"FROM {base}",
            "COPY wheels/ /tmp/wheels/",
            "COPY gitconfig /etc/gitconfig",
            # pip runs from its own wheel (the base has none), with no index: the build is offline.
            f"RUN python3 -m venv --without-pip {ENV_PREFIX}"
            f" && {ENV_PREFIX}/bin/python $(ls /tmp/wheels/pip-*.whl)/pip install --no-index --no-cache-dir"
            f" --disable-pip-version-check --find-links /tmp/wheels pip {reqs}"
            " && rm -rf /tmp/wheels",
            f"ENV PATH={_PATH} PYTHONDONTWRITEBYTECODE=1",
            *(f"LABEL {json.dumps(k)}={json.dumps(v)}" for k, v in sorted(labels.items())),
            "",
        ]
    )


def _instance_dockerfile(env_image: str, labels: dict[str, str]) -> str:
    return "\n".join(
        [
            f"FROM {env_image}",
            f"COPY testbed/ {TESTBED}/",
            f"WORKDIR {TESTBED}",
            *(f"LABEL {json.dumps(k)}={json.dumps(v)}" for k, v in sorted(labels.items())),
            "",
        ]
    )


def build_docker_images(
    instances: list[SweBenchInstance],
    cache: Path,
    packages: dict[tuple[str, str], Package],
    progress: Progress | None = None,
    force: bool = False,
) -> int:
    """Build (or keep) the Docker images of ``instances`` (see the module's description), whose
    repositories are in ``cache``; ``packages`` by (repo, version); ``force``: all again, none of the
    engine's cached layers reused. Returns how many were built.
    """
    docker, client = _docker()
    report = progress or Progress()
    base = docker_image_for("default")
    try:
        base_id = client.images.get(base).id
    except docker.errors.ImageNotFound:
        raise PrepareError(
            f"the base image {base} is missing: run `tangram-server image build --docker`"
        ) from None
    server: ServerProcess | None = None
    python: str | None = None
    built = 0
    env_ids: dict[str, str] = {}
    with ExitStack() as validating:  # the orchestrator validating new images, from the first
        for inst in instances:
            pkg = packages[(inst.repo, inst.version)]
            env_tag = docker_image_for(env_image_name(pkg))
            if env_tag not in env_ids:
                inputs = _digest(base_id, pkg.requirements)
                if force or (_labels_of(client, docker, env_tag) or {}).get(INPUTS_LABEL) != inputs:
                    report.stage(pkg, f"building the Docker environment {env_tag}")
                    python = python or _base_python(client, base)
                    wheels = cache / "wheels" / f"{pkg.slug}-{pkg.version}-py{python}"
                    _download_wheels(pkg, python, wheels)
                    labels = {INPUTS_LABEL: inputs, SET_LABEL: "env"}
                    build_from_context(
                        env_tag,
                        _env_dockerfile(base, pkg, labels),
                        {"wheels": wheels, "gitconfig": _GITCONFIG.encode()},
                        client=client,
                        cache=not force,
                    )
                    built += 1
                env_ids[env_tag] = client.images.get(env_tag).id
            tag = docker_image_for(inst.sandbox_image)
            inputs = _digest(env_ids[env_tag], inst.instance_id, inst.base_commit)
            if not force and (_labels_of(client, docker, tag) or {}).get(INPUTS_LABEL) == inputs:
                continue
            repo = cache / "packages" / f"{pkg.slug}-{pkg.version}" / "repos" / inst.instance_id
            if not (repo / ".git").is_dir():
                raise PrepareError(
                    f"{inst.instance_id}: its repository is missing from {cache}; "
                    "run `tangram-env prepare swe-bench --force`"
                )
            report.stage(pkg, f"building the Docker image {tag}")
            labels = {INPUTS_LABEL: inputs, SET_LABEL: "instance"}
            dockerfile = _instance_dockerfile(env_tag, labels)
            build_from_context(tag, dockerfile, {"testbed": repo}, client=client, cache=not force)
            report.stage(pkg, f"validating {inst.instance_id} in its Docker image")
            if server is None:
                server = validating.enter_context(docker_orchestrator())
            try:
                failure = validate_in_image(inst, server.address)
            except BaseException:  # not validated: the image must not be kept as if it were
                client.images.remove(tag, force=True)
                raise
            if failure is not None:
                client.images.remove(tag, force=True)
                raise PrepareError(f"{inst.instance_id} does not hold in its Docker image {tag}: {failure}")
            built += 1
    return built


def docker_orchestrator(timeout_s: float = 60.0) -> ServerProcess:
    """A ``tangram-server`` child with the Docker sandbox provider and the swe-bench tools, for
    :func:`validate_in_image` (a context manager, or stop it); :class:`PrepareError` if it does not start.
    """
    plugins = ("tangram_env.shell_tools", "tangram_env.envs.swe_bench.tools")
    try:
        return ServerProcess(
            "--sandbox",
            "docker",
            *(a for p in plugins for a in ("--plugin", p)),
            "--parent-pid",
            str(os.getpid()),
            new_session=True,
            timeout_s=timeout_s,
        )
    except ServerUnavailable as exc:
        raise PrepareError(f"validating the Docker images needs an orchestrator: {exc}") from exc


def _call(name: str, **arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def validate_in_image(inst: SweBenchInstance, address: str, timeout_s: float = 600.0) -> str | None:
    """Grade ``inst`` through the env on the orchestrator at ``address`` (one run with the Docker
    sandbox provider: :func:`docker_orchestrator`), so in containers of its Docker image: None if the
    gold patch gets 1.0 and no change 0.0, else what went wrong.
    """
    from tangram_env.envs.swe_bench.env import SweBenchEnv

    end, patch = "TANGRAM_GOLD_PATCH_END", inst.patch if inst.patch.endswith("\n") else inst.patch + "\n"
    apply = _call("bash", command=f"git apply <<'{end}'\n{patch}{end}\n", timeout_s=timeout_s)
    env = SweBenchEnv(
        instances=[inst], address=address, max_turns=2, auto_prepare=False, grade_timeout_s=timeout_s
    )
    try:
        env.reset(seed=0)
        obs, _, _, _, _ = env.step(apply)
        if not obs.startswith("exit code: 0"):
            return f"applying the gold patch failed: {obs[-2000:]}"
        obs, reward, _, _, info = env.step(_call("submit"))
        if reward != 1.0:
            return f"the gold patch gets {reward}, not 1.0 ({info.get('reward_reason') or obs})"
        env.reset(seed=0)
        obs, reward, _, _, info = env.step(_call("submit"))
        if reward != 0.0:
            return f"no change gets {reward}, not 0.0 ({obs})"
    except RewardUnavailable as exc:
        return f"no reward: {exc}"
    finally:
        env.close()
    return None
