"""The Docker provider: each sandbox is one container on a Docker engine (the ``docker`` SDK).

Tangram image names map to Docker images: a name given in ``images`` maps as told, a name with a
``/`` or ``:`` is a Docker reference already (the official SWE-bench images), and any other name
``N`` is ``tangram/N:latest``, which ``tangram-server image build --docker N`` makes with no
registry (``default``: a Debian root file system with Python). Nothing is pulled unless ``pull``.

A container's entrypoint (an image's own ENTRYPOINT and CMD never run) is a small Python init as
PID 1 (:data:`_INIT_PY`), which nothing run inside the container can end: commands run as the
container's root, and a command that signals every process (``kill -9 -1``) or PID 1 itself must fail
as its own, never stop its container (a grading then read as lost to the infrastructure, no reward,
instead of the 0.0 it earned). The kernel drops SIGKILL and SIGSTOP sent to a PID namespace's init from
inside it; the init ignores every other signal but SIGCHLD, which it reaps on, and cannot be traced.
An image without ``python3`` falls back to ``sleep infinity`` under Docker's ``init`` (tini), which a
command inside can stop (with a warning). PID 1 adopts what a command leaves running; each exec kills
those orphans once its command ends, and an exec that died of a signal has them killed again from an
exec of their own (a command may kill the shell that reaps), so nothing outlives its command (as with
the local provider). The container has memory capped and swap off, a process cap, a writable layer of
``disk_mb`` where the engine can cap it (``disk_quota``), no network unless the spec allows it, and
Docker's default capabilities less raw sockets, device nodes and chroot. An exec on granted cores
first sets the container's CPU set and CFS quota to those cores together with those of the sandbox's
other execs running at once (the scheduler's per-action CPU lending; it shrinks back as they end),
then streams the command's output, cutting each stream at ``max_output_bytes`` and killing the
command past ``output_kill_bytes``. ``reset`` replaces the container with a fresh one, and removes
the old one even when the new one fails; a container that fails its preparation is removed. An exec
returns by its time limit (plus the kill grace): past it, it stops reading and kills the command's
process group, even if a process that left the group still holds the output open. So it is
``bounded_exec``: the server's own tools call it from a thread (an HTTP request, no fork of the
orchestrator).

The SDK's client holds pooled HTTP connections, so it never crosses a ``fork()``: each process
(the orchestrator, each forked action child) makes its own. Containers carry labels naming the
server process that made them (with the boot and the PID namespace its pid belongs to). A reaper
process (:mod:`.docker_reaper`) removes them when that server ends, however it ends; a provider
starting on the same host removes any whose server is gone (a process of its own PID namespace that
no longer runs, or of an earlier boot); another PID namespace's servers it cannot look at, and leaves.
"""

from __future__ import annotations

import io
import logging
import os
import posixpath
import select
import shlex
import socket
import subprocess
import sys
import tarfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

from tangram_env.docker_build import docker_image_for, docker_sdk
from tangram_env.sandbox import (
    ExecResult,
    SandboxBroken,
    SandboxError,
    SandboxPathError,
    SandboxRequestError,
    SandboxSpec,
    SandboxUnavailable,
    check_file_size,
)
from tangram_env.server.sandbox.cgroups import CFS_PERIOD_US, format_cpus
from tangram_env.server.sandbox.execspec import ExecPlan, plan_exec, result_from
from tangram_env.server.sandbox.procrun import OutputCapture, RunOutcome

log = logging.getLogger(__name__)

#: Label every Tangram container carries, and the one naming the server process that owns it.
LABEL = "tangram.sandbox"
OWNER_LABEL = "tangram.owner"
#: Where commands start when the image names no working directory.
WORKSPACE = "/workspace"
#: The cgroup files (v1, then v2) with the counters an exec's limits are told from, and their keys.
_COUNTER_FILES = (
    ("oom_kill", "/sys/fs/cgroup/memory/memory.oom_control"),
    ("oom_kill", "/sys/fs/cgroup/memory.events"),
    ("max", "/sys/fs/cgroup/pids/pids.events"),
    ("max", "/sys/fs/cgroup/pids.events"),
)
#: Exit status of coreutils ``timeout`` when the limit struck (and 128+9 after its ``-k`` grace).
_TIMEOUT_EXIT = 124
_KILL_GRACE_S = 2
#: How long past its time limit and kill grace an exec keeps reading (the engine's own latency).
_READ_SLACK_S = 3.0

#: The word in PID 1's argv that tells it is our init.
_INIT_MARK = "tangram-init"
#: PID 1 of a container (Python 3, any version): the kernel drops the signals it has no handler for
#: when sent from inside its PID namespace (SIGKILL and SIGSTOP always), so it ignores every one but
#: SIGCHLD, which it waits for, blocked (no handler: no race with a wait), to reap what it adopts. Not
#: dumpable: the container's root (no CAP_SYS_PTRACE) could otherwise ptrace it into exiting.
_INIT_PY = """
import os, signal
try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
except Exception:
    pass
for s in range(1, signal.NSIG):
    if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
        try:
            signal.signal(s, signal.SIG_IGN)
        except (OSError, ValueError, RuntimeError):
            pass
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
while True:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
        except InterruptedError:
            pass
    signal.sigwaitinfo([signal.SIGCHLD])
"""
#: Runs :data:`_INIT_PY` as PID 1, or exits 127 where the image has no python3 (the provider falls back).
_INIT_ENTRYPOINT = [
    "sh",
    "-c",
    f'command -v python3 >/dev/null 2>&1 || exit 127; exec python3 -E -S -c "$0" {_INIT_MARK}',
    _INIT_PY,
]


def _process_start(pid: int) -> str:
    """The start time of ``pid`` in clock ticks since boot ('' if gone): a pid plus this is unique."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return ""


def _boot_id() -> str:
    """The running boot's id ('' if unreadable): a process of an earlier boot is gone, whatever its pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """The inode of this process's PID namespace ('' if unreadable): pids of another mean nothing here."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def owner_label() -> str:
    """``host:pid:start:nonce:boot:pidns`` of a provider of this process: what its containers' owner
    label says (the nonce tells apart providers of one process, so that one's reaper leaves the others'
    alone; the boot id and PID namespace tell whether this host's pid names the same process here).
    """
    pid = os.getpid()
    fields = (
        socket.gethostname(),
        pid,
        _process_start(pid),
        uuid.uuid4().hex[:8],
        _boot_id(),
        _pid_namespace(),
    )
    return ":".join(map(str, fields))


def owner_is_gone(label: str) -> bool:
    """True when ``label`` names a process of this host that no longer runs: one of an earlier boot,
    or one of this PID namespace whose pid and start time no longer match. Other hosts', and other
    PID namespaces' (another server on this host name, in a container of its own), are never gone:
    their pids cannot be looked up here. Labels of 3 and 4 fields (older servers) name no boot or
    namespace and are taken as this boot's and this namespace's.
    """
    host, pid, start, _nonce, boot, namespace = [*label.split(":"), "", "", "", "", ""][:6]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    ours = _boot_id()
    if boot and ours and boot != ours:
        return True  # its server died with the last boot
    if namespace and namespace != _pid_namespace():
        return False
    return _process_start(int(pid)) != start


def _shut(sock: Any) -> None:
    """Shut and close an exec's attached socket (the SDK wraps it in a ``SocketIO``)."""
    raw = getattr(sock, "_sock", sock)
    try:
        raw.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
    raw.close()


_STDERR = 2


def _frames(raw: socket.socket, deadline: float) -> Iterator[tuple[int, bytes]]:
    """The (stream, bytes) frames of an exec's attached stream until it ends, or TimeoutError.

    ``deadline`` is on the monotonic clock (the SDK's own reader waits without any limit). The
    engine's framing: a byte naming the stream, three zero bytes, a big-endian 32-bit length, then
    that many bytes.
    """
    poller = select.poll()
    poller.register(raw, select.POLLIN | select.POLLPRI)
    buffer = bytearray()

    def fill(n: int) -> bool:
        while len(buffer) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TimeoutError("the exec's output stream outlived its time limit")
            chunk = raw.recv(max(65536, n - len(buffer)))
            if not chunk:
                return False
            buffer.extend(chunk)
        return True

    while fill(8):
        stream, size = buffer[0], int.from_bytes(buffer[4:8], "big")
        del buffer[:8]
        if not fill(size):
            return
        yield stream, bytes(buffer[:size])
        del buffer[:size]


class _Engine:
    """A Docker client per process: made on first use in each process, never inherited across fork."""

    def __init__(self, base_url: str | None, timeout_s: float) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self._client: Any = None
        self._pid = -1
        self._lock = threading.Lock()
        # A fork while another thread held the lock would leave it held for good in the child.
        engine = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _Engine._new_lock(engine()))

    @staticmethod
    def _new_lock(engine: _Engine | None) -> None:
        if engine is not None:
            engine._lock = threading.Lock()

    def client(self) -> Any:
        with self._lock:
            if self._pid != os.getpid():
                docker = docker_sdk()
                # The parent's client (if any) is dropped unclosed: its sockets are the parent's.
                if self.base_url:
                    self._client = docker.DockerClient(base_url=self.base_url, timeout=int(self.timeout_s))
                else:
                    self._client = docker.from_env(timeout=int(self.timeout_s))
                self._pid = os.getpid()
            return self._client


def _start_reaper(owner: str, base_url: str | None) -> tuple[subprocess.Popen[bytes], int] | None:
    """Start the process that removes ``owner``'s containers once this process is gone (see
    :mod:`~tangram_env.server.sandbox.docker_reaper`); the write end of its lifeline, never
    inherited by commands this process runs, and the process. None, with a warning, if it cannot start.
    """
    read_end, write_end = os.pipe()
    try:
        reaper = subprocess.Popen(
            [sys.executable, "-m", "tangram_env.server.sandbox.docker_reaper", owner, base_url or ""],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C, or a kill of the server's group, spares it
        )
    except OSError as exc:
        os.close(write_end)
        log.warning(
            "cannot start the Docker reaper (%s): a killed server's containers stay until a server next "
            "starts here",
            exc,
        )
        return None
    finally:
        os.close(read_end)
    return reaper, write_end


class DockerProvider:
    """Makes :class:`DockerSandbox` es on a Docker engine (see the module's description).

    ``base_url`` selects the engine (default: ``$DOCKER_HOST`` or the local socket); ``images`` maps
    Tangram image names to Docker images; ``pull`` allows pulling images that are missing;
    ``workspace`` is where commands start when the image names no working directory; ``sweep``
    removes containers left by a server of this host that died; ``disk_quota`` caps each container's
    writable layer at the spec's ``disk_mb`` (the engine must support ``--storage-opt size``).
    """

    name = "docker"

    def __init__(
        self,
        *,
        base_url: str | None = None,
        images: dict[str, str] | None = None,
        pull: bool = False,
        workspace: str = WORKSPACE,
        request_timeout_s: float = 60.0,
        sweep: bool = True,
        disk_quota: bool = False,
    ) -> None:
        docker = docker_sdk()
        self.engine = _Engine(base_url, request_timeout_s)
        try:
            info = self.engine.client().info()
        except docker.errors.DockerException as exc:
            raise SandboxUnavailable(
                f"no Docker engine answers here ({exc}); start one (`dockerd`, or `systemctl start docker`) "
                "or point DOCKER_HOST at one"
            ) from exc
        self.host_cpus = frozenset(range(int(info.get("NCPU") or os.cpu_count() or 1)))
        self.images = dict(images or {})
        self.pull = pull
        self.workspace = workspace
        self.disk_quota = disk_quota
        if not disk_quota:
            log.warning(
                "Docker sandboxes' disk is not capped (disk_mb is not enforced): a sandbox can fill the "
                "engine's disk; set the docker provider's disk_quota option on an engine whose storage "
                "driver supports --storage-opt size (overlay2 on xfs with project quotas)"
            )
        self.owner = owner_label()
        self._reaper = _start_reaper(self.owner, base_url)
        self.sandboxes: dict[str, DockerSandbox] = {}
        provider = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: DockerProvider._forget_running(provider()))
        self._workdirs: dict[str, str] = {}
        self._own_init: dict[str, bool] = {}  # by Docker image: whether our init runs in it (python3)
        if sweep:
            removed = self.sweep()
            if removed:
                log.warning("removed %d Docker sandbox(es) left by a server that died", removed)
        base = docker_image_for("default", self.images)
        if not self.client().images.list(name=base.rpartition(":")[0]):
            log.warning(
                "Docker image %s (Tangram image 'default') is not here: sandboxes of it will fail until "
                "`tangram-server image build --docker` builds it",
                base,
            )

    def client(self) -> Any:
        """The Docker client of the calling process."""
        return self.engine.client()

    @staticmethod
    def _forget_running(provider: DockerProvider | None) -> None:
        """In a forked child: its sandboxes' execs running now are the parent's (see theirs)."""
        if provider is not None:
            for sandbox in list(provider.sandboxes.values()):
                sandbox._forget_running()

    def sweep(self) -> int:
        """Remove containers whose owning server (a process of this host) is gone; how many."""
        removed = 0
        api = self.client().api
        # The listing's own fields: `containers.list` inspects each container after listing, and one
        # removed in between (by its server's reaper, another sweeper) failed this server's start.
        for container in api.containers(all=True, filters={"label": LABEL}):
            if owner_is_gone((container.get("Labels") or {}).get(OWNER_LABEL, "")):
                try:
                    api.remove_container(container["Id"], force=True)
                    removed += 1
                except Exception as exc:  # removed meanwhile
                    log.debug("could not remove stale container %s: %s", container["Id"][:12], exc)
        return removed

    def _workdir(self, image: str) -> str:
        """Where commands start in ``image``: its own working directory, else ``workspace``."""
        if image not in self._workdirs:
            docker = docker_sdk()
            try:
                found = self.client().images.get(image)
            except docker.errors.ImageNotFound:
                if not self.pull:
                    raise SandboxUnavailable(
                        f"Docker image {image!r} is not on this engine: build it (`tangram-server image "
                        "build --docker NAME` makes tangram/NAME; `tangram-env prepare swe-bench --docker` "
                        "the offline swe-bench set's), load it (`docker load`), or allow pulling (the "
                        "docker provider's `pull` option)"
                    ) from None
                try:
                    found = self.client().images.pull(image)
                except docker.errors.APIError as exc:
                    raise SandboxUnavailable(f"could not pull Docker image {image!r}: {exc}") from exc
            self._workdirs[image] = (found.attrs.get("Config") or {}).get("WorkingDir") or self.workspace
        return self._workdirs[image]

    def start_container(self, spec: SandboxSpec) -> tuple[Any, str]:
        """A running container for ``spec`` with its limits, and its working directory."""
        image = docker_image_for(spec.image, self.images)
        workdir = self._workdir(image)
        own_init = self._own_init.get(image, True)
        container = self._start(image, spec, workdir, own_init)
        if image not in self._own_init:  # the first container of this image tells whether it has python3
            self._own_init[image] = own_init = self._runs_own_init(container)
            if not own_init:
                _remove_container(self.client(), container.id)
                log.warning(
                    "Docker image %s has no python3: its containers run `sleep infinity` under Docker's "
                    "init, which a command inside can stop (`kill -9 -1`), failing the sandbox instead of "
                    "the command; install python3 in the image",
                    image,
                )
                container = self._start(image, spec, workdir, own_init)
        return container, workdir

    def _runs_own_init(self, container: Any, wait_s: float = 10.0) -> bool:
        """Whether ``container``'s PID 1 became :data:`_INIT_PY` (False once it exited: no python3)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            container.reload()
            if container.status != "running":
                return False
            try:
                ran = container.exec_run(["cat", "/proc/1/cmdline"])
            except docker_sdk().errors.DockerException:
                continue  # it exited meanwhile: the next look tells
            argv = (ran.output or b"").split(b"\0")
            if ran.exit_code == 0 and b"python" in argv[0] and _INIT_MARK.encode() in argv:
                return True
            time.sleep(0.05)  # its shell has not exec'd python3 yet
        return False

    def _start(self, image: str, spec: SandboxSpec, workdir: str, own_init: bool) -> Any:
        """A started container of ``image`` for ``spec``, PID 1 our init (else tini + `sleep infinity`)."""
        docker = docker_sdk()
        try:
            # The entrypoint is set whole: an image's own ENTRYPOINT (most images from a registry have
            # one) took ours for arguments, and the container exited at once.
            container = self.client().containers.create(
                image,
                entrypoint=_INIT_ENTRYPOINT if own_init else ["sleep", "infinity"],
                init=not own_init,
                name=f"tangram-{uuid.uuid4().hex[:12]}",
                labels={LABEL: "1", OWNER_LABEL: self.owner, "tangram.image": spec.image},
                network_mode="bridge" if spec.network else "none",
                mem_limit=f"{spec.mem_mb}m",
                memswap_limit=f"{spec.mem_mb}m",  # equal to the memory limit: no swap
                pids_limit=spec.max_pids,
                # Docker's size quota needs overlay2 on xfs with pquota; elsewhere disk is not capped.
                storage_opt={"size": f"{spec.disk_mb}m"} if self.disk_quota else None,
                ulimits=[
                    docker.types.Ulimit(name="nofile", soft=spec.max_open_files, hard=spec.max_open_files),
                    docker.types.Ulimit(name="core", soft=0, hard=0),
                ],
                cap_drop=["NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT", "SETFCAP"],
                security_opt=["no-new-privileges"],
                working_dir=workdir,
                environment=dict(spec.env),
            )
        except docker.errors.DockerException as exc:
            raise SandboxError(f"could not create a container of {image!r}: {exc}") from exc
        try:
            container.start()
        except docker.errors.DockerException as exc:
            _remove_container(self.client(), container.id)  # created, never started: no sandbox holds it
            raise SandboxError(f"could not start a container of {image!r}: {exc}") from exc
        return container

    def create(self, spec: SandboxSpec) -> DockerSandbox:
        """A new sandbox (container) for ``spec``."""
        container, workdir = self.start_container(spec)
        try:
            sandbox = DockerSandbox(self, spec, container.id, workdir)
        except BaseException:
            # No sandbox holds it, so nothing would remove it before this server exits.
            _remove_container(self.client(), container.id)
            raise
        self.sandboxes[sandbox.id] = sandbox
        return sandbox

    def close(self) -> None:
        """Remove every container this provider made."""
        for sandbox in list(self.sandboxes.values()):
            sandbox.close()
        if self._reaper is not None:
            os.close(self._reaper[1])  # it finds nothing left and exits
            self._reaper = None


def _remove_container(client: Any, container_id: str) -> None:
    """Remove a container, running or not (one already gone is no error)."""
    try:
        client.api.remove_container(container_id, force=True)
    except Exception:  # already gone
        pass


#: Bits of Go's ``os.FileMode`` (the ``mode`` of the stat the engine sends with an archive): a
#: symbolic link, and any kind of file but a regular one (directory, link, device, pipe, socket,
#: character device, irregular).
_GO_MODE_SYMLINK = 1 << 27
_GO_MODE_TYPE = (1 << 31) | (1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
#: What a one-file tar archive holds beyond the file's bytes, at most (its header, a long name's PAX
#: header, padding and the end blocks), and how much of an archive is read at once.
_TAR_OVERHEAD = 64 << 10
_ARCHIVE_CHUNK = 64 << 10

_SETTLE_LOOKS, _SETTLE_S = 5, 0.1  # a SIGKILL from outside: the engine shows the stop within this

# Shell (builtins only: no fork per process) that sets `pp` to the parent pid of process `$p` read
# from /proc/$p/stat; the command name, second, may hold spaces and `)`, so it is cut up to the last `) `.
_PARENT_OF_P = 'read -r line < "$d/stat" 2>/dev/null || continue; set -- ${line##*) }; pp=$2;'
#: Prints `init 1` when PID 1 is our init, else `keeper PID` for each child of PID 1 (Docker's init,
#: the fallback): in a fresh container, its `sleep infinity`.
_KEEPER_SCRIPT = (
    f'case " $(tr "\\0" " " < /proc/1/cmdline) " in *" {_INIT_MARK} "*) echo "== init"; echo "init 1";; '
    f'*) echo "== keeper"; for d in /proc/[0-9]*; do p=${{d#/proc/}}; {_PARENT_OF_P} '
    '[ "$pp" = 1 ] && echo "keeper $p"; done;; esac;'
)


def _reap_orphans(keeper: int) -> str:
    """Shell that SIGKILLs every process whose parent is PID 1 other than ``keeper`` (0: none, under
    our init), pass after pass (a killed process's children are orphans next pass; a fork bomb's forks
    too), up to 100 passes.

    A command's leftovers are orphans once it ends (PID 1 adopts them); a running command's own
    processes descend from its exec, whose parent is outside the container, so they are spared.
    """
    return (
        "n=0; while [ $n -lt 100 ]; do n=$((n+1)); found=; "
        f'for d in /proc/[0-9]*; do p=${{d#/proc/}}; [ "$p" = {keeper} ] && continue; {_PARENT_OF_P} '
        '[ "$pp" = 1 ] && kill -KILL "$p" 2>/dev/null && found=1; done; [ -n "$found" ] || break; done;'
    )


class DockerSandbox:
    """One container; see the module's description."""

    bounded_exec = True

    def __init__(self, provider: DockerProvider, spec: SandboxSpec, container_id: str, workdir: str) -> None:
        self.provider = provider
        self.spec = spec
        self.container_id = container_id
        self.workspace = workdir
        self.id = f"docker-{container_id[:12]}"
        # When its container started: one restarted from outside (`docker restart`) killed every
        # process in it, and its commands must not read as exits of their own.
        self._started_at: str | None = None
        self._counters = (0, 0)
        self._keeper = 0
        # The cores of this process's execs running now, by exec: the container's CPU set is their union.
        self._cores_lock = threading.Lock()
        self._running: dict[object, tuple[int, ...]] = {}
        self._prepare()

    def _forget_running(self) -> None:
        """In a forked child: the parent's execs are not the child's, and a lock held by another of
        the parent's threads at the fork would stay held for good.
        """
        self._cores_lock = threading.Lock()
        self._running = {}

    def _prepare(self) -> None:
        """Make the working directory, check PID 1 is our init (else, the fallback, note Docker's init's
        `sleep infinity`, the one process commands must not reap) and read its cgroup's counters: one exec.
        """
        workdir = shlex.quote(self.workspace)
        found = self._read_cgroup(prepare=f"mkdir -p {workdir}; {_KEEPER_SCRIPT}")
        self._counters = (found.get("oom_kill", 0), found.get("max", 0))
        self._keeper = 0 if found.get("init") else found.get("keeper", 0)
        if not (found.get("init") or self._keeper):
            raise SandboxError(
                f"container {self.id}: its own process (Tangram's init, or `sleep infinity` under Docker's "
                "init where the image has no python3) is not running; the image's python3 or sleep fails"
            )

    def _container(self) -> Any:
        docker = docker_sdk()
        try:
            return self.provider.client().containers.get(self.container_id)
        except docker.errors.NotFound as exc:
            raise SandboxBroken("its container is gone", self.id) from exc
        except docker.errors.DockerException as exc:
            raise SandboxBroken(f"the Docker engine does not answer: {exc}", self.id) from exc

    def _inspect(self, api: Any) -> dict[str, Any]:
        docker = docker_sdk()
        try:
            found: dict[str, Any] = api.inspect_container(self.container_id)
        except docker.errors.NotFound as exc:
            raise SandboxBroken("its container is gone", self.id) from exc
        except docker.errors.DockerException as exc:
            raise SandboxBroken(f"the Docker engine does not answer: {exc}", self.id) from exc
        state = found.get("State") or {}
        if not state.get("Running") or state.get("Paused"):
            raise SandboxBroken(f"its container is {state.get('Status', 'not running')}", self.id)
        started = state.get("StartedAt")
        if self._started_at is None:
            self._started_at = started
        elif started != self._started_at:
            raise SandboxBroken("its container was restarted, and every process in it killed", self.id)
        return found

    def _path(self, path: str) -> str:
        if not path or "\0" in path:
            raise SandboxRequestError(f"bad path {path!r}")
        return path if path.startswith("/") else posixpath.join(self.workspace, path)

    def _check_not_killed_from_outside(self, api: Any, code: int) -> None:
        """Raise :class:`SandboxBroken` if the container was stopped, removed or restarted under a
        command (its exit, 137 say, is then not the command's own). A SIGKILL nobody here sent may
        be a stop the engine has not shown yet: it is looked at again for a moment.
        """
        self._inspect(api)
        if code == 128 + 9:
            for _ in range(_SETTLE_LOOKS):
                time.sleep(_SETTLE_S)
                self._inspect(api)

    def _read_counters(self) -> tuple[int, int]:
        """The container's OOM kills and forks refused at its pids limit, from its cgroup (v1's
        ``memory.oom_control`` and ``pids/pids.events``, or v2's ``memory.events`` and ``pids.events``).
        """
        found = self._read_cgroup()
        return found.get("oom_kill", self._counters[0]), found.get("max", self._counters[1])

    def _read_cgroup(self, prepare: str = "", tries: int = 5) -> dict[str, int]:
        """The counters of :meth:`_read_counters` by key, after running ``prepare`` (a shell prefix,
        which may print keys of its own: one exec does both).

        Right after a limit struck, the reading shell itself may not start or may be killed (the
        killed process's memory or pids not freed yet): then it tries again, a little later, and
        gives nothing (the caller keeps the last counts it knows) if every try fails.
        """
        script = prepare + " ".join(
            f"[ -r {path} ] && echo '== {key}' && cat {path};" for key, path in _COUNTER_FILES
        )
        for attempt in range(tries):
            if attempt:
                time.sleep(0.1 * attempt)
            try:
                ran = self._container().exec_run(["sh", "-c", script + " true"])
            except Exception:
                continue
            if ran.exit_code != 0:  # the shell did not run to its end
                continue
            found: dict[str, int] = {}
            wanted = ""
            for line in (ran.output or b"").decode(errors="replace").splitlines():
                if line.startswith("== "):
                    wanted = line[3:]
                    continue
                key, _, value = line.partition(" ")
                if key == wanted and value.strip().isdigit():
                    found[key] = int(value)
            return found
        log.warning("sandbox %s: could not read its cgroup's limit counters", self.id)
        return {}

    def exec(
        self,
        cmd: str | list[str],
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cores: tuple[int, ...] = (),
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` in the container on ``cores`` (its CPU set and quota), with the spec's limits."""
        plan = plan_exec(self.spec, cmd, timeout_s, cores, self.provider.host_cpus, cwd, self.workspace)
        api = self.provider.client().api
        if not plan.cores:
            self._inspect(api)
            return self._run(api, plan, env, stdin)
        running = object()
        self._pin(api, running, plan.cores)
        try:
            return self._run(api, plan, env, stdin)
        finally:
            self._unpin(api, running)

    def _cores_running(self) -> tuple[int, ...]:
        """The union of the cores of this process's execs running now (call under ``_cores_lock``)."""
        return tuple(sorted({core for cores in self._running.values() for core in cores}))

    def _set_cores(self, api: Any, cores: tuple[int, ...]) -> None:
        """Set the container's CPU set to ``cores`` and its CFS quota to one period per core."""
        api.update_container(
            self.container_id,
            cpuset_cpus=format_cpus(cores),
            cpu_period=CFS_PERIOD_US,
            cpu_quota=CFS_PERIOD_US * len(cores),
        )

    def _pin(self, api: Any, running: object, cores: tuple[int, ...]) -> None:
        """Add an exec's ``cores`` to the container's CPU set and quota, which the execs running at once
        share: the union of their cores (each setting the container to its own cores alone moved the
        others onto them). Skipped when the container is set so already.
        """
        with self._cores_lock:
            host = self._inspect(api)["HostConfig"]
            self._running[running] = cores
            union = self._cores_running()
            try:
                if (host.get("CpusetCpus"), host.get("CpuQuota")) != (
                    format_cpus(union),
                    CFS_PERIOD_US * len(union),
                ):
                    self._set_cores(api, union)
            except BaseException:
                self._running.pop(running, None)
                raise

    def _unpin(self, api: Any, running: object) -> None:
        """Take an ended exec's cores out: the container shrinks to the union of the others' (when none
        is left, it stays as it is until the next exec on cores sets its own).
        """
        with self._cores_lock:
            before = self._cores_running()
            self._running.pop(running, None)  # absent in a child forked meanwhile
            after = self._cores_running()
            if after and after != before:
                try:
                    self._set_cores(api, after)
                except Exception as exc:  # the container gone: the others' execs will tell
                    log.warning("sandbox %s: could not shrink its CPU set to %s: %s", self.id, after, exc)

    def _run(self, api: Any, plan: ExecPlan, env: dict[str, str] | None, stdin: bytes | None) -> ExecResult:
        """Run a planned exec in the container, its CPU set already set; see :meth:`exec`."""
        files = f"/tmp/.tangram-{uuid.uuid4().hex[:10]}"
        shell = shlex.join(plan.argv)
        if stdin is not None:
            feed = f"/var/tmp/{files[5:]}.in"  # not a tmpfs: put_archive cannot write into one
            self.write_file(feed, stdin)
            shell = f"{shell} < {feed}; rm -f {feed}"
        # `timeout` leads a process group of its own; its pid goes to a file so that a flood of output
        # can have that whole group killed from a second exec. The wrapper then cleans up.
        # What it leaves (`nohup`, `setsid`, a fork bomb) is reaped once it ends, as the local provider
        # does: it would burn cores granted to others and meet the session's next command.
        wrapper = (
            f'timeout -k {_KILL_GRACE_S} {plan.timeout_s:.3f} sh -c "$0" & echo $! > {files}.pid; '
            f"wait $!; status=$?; {_reap_orphans(self._keeper)} rm -f {files}.pid; exit $status"
        )
        environment = {**self.spec.env, **(env or {}), **plan.core_env}
        started = time.monotonic()
        out, err = OutputCapture(self.spec.max_output_bytes), OutputCapture(self.spec.max_output_bytes)
        flooded = overdue = False
        deadline = started + plan.timeout_s + _KILL_GRACE_S + _READ_SLACK_S
        try:
            exec_id = api.exec_create(
                self.container_id, ["sh", "-c", wrapper, shell], workdir=plan.cwd, environment=environment
            )["Id"]
            sock = api.exec_start(exec_id, socket=True)
            try:
                for stream_id, data in _frames(getattr(sock, "_sock", sock), deadline):
                    (err if stream_id == _STDERR else out).add(data)
                    if out.total + err.total > self.spec.output_kill_bytes:
                        flooded = True
                        break
            except TimeoutError:
                # Its group was killed at the limit, yet the stream is open: a process that left the
                # group holds it. Stop reading; the limit is what the caller gave.
                overdue = True
            finally:
                # Shut the connection itself: the client's pool must not hand out one with output unread.
                _shut(sock)
            if flooded or overdue:
                kill = api.exec_create(self.container_id, ["sh", "-c", f"kill -KILL -$(cat {files}.pid)"])
                api.exec_start(kill["Id"])
            if overdue:
                self._check_engine_delivered(api, exec_id, plan.timeout_s)
            code = 128 + 9 if flooded or overdue else self._exit_code(api, exec_id)
        except SandboxError:
            raise
        except Exception as exc:  # the container died or the engine went away
            raise SandboxBroken(f"docker exec failed: {type(exc).__name__}: {exc}", self.id) from exc
        wall = time.monotonic() - started
        if code is None:
            raise SandboxBroken("docker exec ended without an exit status", self.id)
        if code >= 128:
            # Died of a signal: the command's, or the wrapper's own (a command may SIGKILL the shell
            # that reaps what it leaves), so the reap may not have run.
            self._reap_leftovers(api)
        timed_out = overdue or (
            not flooded and (code == _TIMEOUT_EXIT or (code == 128 + 9 and wall >= plan.timeout_s))
        )
        oom = pids_max = False
        if code != 0 and not timed_out and not flooded:  # a limit may be why: one exec tells
            before, self._counters = self._counters, self._read_counters()
            oom, pids_max = self._counters[0] > before[0], self._counters[1] > before[1]
        if code != 0 and not (timed_out or flooded or oom or pids_max):
            self._check_not_killed_from_outside(api, code)
        outcome = RunOutcome(
            returncode=code,
            signal=None,
            stdout=out.value(),
            stderr=err.value(),
            stdout_dropped=out.dropped,
            stderr_dropped=err.dropped,
            wall_s=wall,
            cpu_s=0.0,  # Docker reports no CPU time per exec
            timed_out=timed_out,
            output_exceeded=flooded,
        )
        return result_from(outcome, self.spec, oom=oom, pids_max=pids_max)

    def _reap_leftovers(self, api: Any) -> None:
        """Kill what commands left running (see :func:`_reap_orphans`) from an exec of its own."""
        try:
            reap = api.exec_create(self.container_id, ["sh", "-c", _reap_orphans(self._keeper) + " true"])
            api.exec_start(reap["Id"])
        except Exception as exc:  # the container gone: the checks that follow tell
            log.debug("sandbox %s: could not reap what its command left: %s", self.id, exc)

    def _check_engine_delivered(self, api: Any, exec_id: str, limit_s: float) -> None:
        """An exec read to its deadline ran over its limit (its ``timeout`` fired), unless it had ended
        by itself and the engine held its output back (a stalled daemon): then its outcome is lost to
        the engine, never a time-out of the command's (in a grading, the patch's failure).
        """
        state = api.exec_inspect(exec_id)
        code = state.get("ExitCode")
        if not state.get("Running") and code is not None and code not in (_TIMEOUT_EXIT, 128 + 9):
            raise SandboxBroken(
                f"the Docker engine held back the output of a command that ended (exit {code}) within its "
                f"{limit_s:g}s limit; its outcome is unknown",
                self.id,
            )

    @staticmethod
    def _exit_code(api: Any, exec_id: str, wait_s: float = 10.0) -> int | None:
        """The exec's exit status, once the engine has it (right away unless the stream was cut)."""
        deadline = time.monotonic() + wait_s
        while True:
            state = api.exec_inspect(exec_id)
            if not state.get("Running") or time.monotonic() > deadline:
                return state.get("ExitCode")
            time.sleep(0.05)

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` at ``path`` (relative: under the workspace), through ``put_archive``."""
        raw = data.encode("utf-8") if isinstance(data, str) else data
        full = self._path(path)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(posixpath.basename(full))
            info.size, info.mtime, info.mode = len(raw), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(raw))
        container = self._container()
        parent = posixpath.dirname(full) or "/"
        try:
            container.exec_run(["mkdir", "-p", parent])
            written = container.put_archive(parent, buf.getvalue())
        except Exception as exc:
            raise SandboxError(f"could not write {full} in container {self.id}: {exc}") from exc
        if not written:
            raise SandboxError(f"could not write {full} in container {self.id}")

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The bytes at ``path`` (FileNotFoundError if absent), through ``get_archive``; a link or a
        directory is refused, as the local provider refuses them.

        The archive's stat (what the engine sends before the archive) refuses a link, a directory and a
        file over ``max_bytes`` before any of it is read: a directory's archive holds its whole tree,
        which a sparse file can make gigabytes on no disk. The archive is then read a chunk at a time,
        and given up past what the file may hold (``max_bytes``, else its stat's size) and the tar's
        headers: a file that grows as it is read is refused as too large.
        """
        full = self._path(path)
        container = self._container()
        try:
            stream, info = container.get_archive(full, chunk_size=_ARCHIVE_CHUNK)
        except Exception as exc:
            raise FileNotFoundError(full) from exc
        try:
            stat = info or {}
            mode = int(stat.get("mode", 0))
            if mode & _GO_MODE_SYMLINK:
                raise SandboxPathError(f"cannot read {full}: it is a symbolic link (links are not followed)")
            if mode & _GO_MODE_TYPE:
                raise SandboxPathError(f"cannot read {full}: it is not a regular file")
            size = int(stat.get("size", 0))
            check_file_size(full, size, max_bytes)
            may_hold = size if max_bytes is None else max_bytes
            raw = bytearray()
            try:
                for chunk in stream:
                    raw += chunk
                    if len(raw) > may_hold + _TAR_OVERHEAD:
                        check_file_size(full, len(raw) - _TAR_OVERHEAD, may_hold)
            except SandboxError:
                raise
            except Exception as exc:
                raise FileNotFoundError(full) from exc
        finally:
            stream.close()  # drops the engine's response: a refused archive is never read to its end
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            member = tar.next()
            if member is None:
                raise FileNotFoundError(full)
            if not member.isfile():  # changed since its stat: the link itself, or the directory's tree
                what = "a symbolic link (links are not followed)" if member.issym() else "not a regular file"
                raise SandboxPathError(f"cannot read {full}: it is {what}")
            check_file_size(full, member.size, max_bytes)
            handle = tar.extractfile(member)
            assert handle is not None  # a regular file's member always has its data
            return handle.read()

    def health(self) -> str | None:
        """None while the container runs, else why not."""
        try:
            self._inspect(self.provider.client().api)
        except SandboxBroken as exc:
            return exc.reason
        return None

    def reset(self) -> None:
        """A fresh container from the image replaces this one. The old one is removed even if the new
        one fails (the previous session's files and processes must not outlive it), and so is a new one
        that fails its preparation; the sandbox is then broken, and its pool discards it.
        """
        old = self.container_id
        try:
            container, self.workspace = self.provider.start_container(self.spec)
            self.provider.sandboxes.pop(self.id, None)
            self.container_id = container.id
            self.id = f"docker-{container.id[:12]}"
            self._started_at = None
            self.provider.sandboxes[self.id] = self
            self._counters = (0, 0)
            try:
                self._prepare()
            except BaseException:
                self._remove(container.id)
                raise
        finally:
            self._remove(old)

    def close(self) -> None:
        """Remove the container."""
        self.provider.sandboxes.pop(self.id, None)
        self._remove(self.container_id)

    def _remove(self, container_id: str) -> None:
        _remove_container(self.provider.client(), container_id)
