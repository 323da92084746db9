"""The local provider: isolated sandboxes on this host, made with bubblewrap, cgroups and rlimits.

A sandbox is a directory on the host (its workspace and tmp on a size-capped tmpfs when the server
is root), a memory and a pids cgroup, and, when the server is root, a user id of its own. Where the
host allows (root, cgroups; on v2, Linux 5.16 or later), one bubblewrap with its pid, network, IPC
and UTS namespaces lives as long as the sandbox, holding an exec agent (:mod:`.agent`,
:mod:`.agentlink`): each ``exec`` is a fork and an exec there, placed in a per-exec cgroup and
pinned to the granted cores before it runs, and what it leaves behind is killed when it ends.
Elsewhere each ``exec`` starts a fresh bubblewrap, joined to the sandbox's cgroups, so nothing it
starts outlives it (when the exec's first process ends, the kernel kills the rest of its pid
namespace). Files persist between execs; :meth:`LocalSandbox.reset` restores the image's workspace.

Everything a sandbox needs is on the file system or in its fields, so a forked child of the process
that created it can run ``exec`` and the parent sees the files it wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import platform
import resource
import secrets
import shutil
import subprocess
import tempfile
import time
import uuid
from typing import TYPE_CHECKING

from tangram_env.images import Image, get_image
from tangram_env.sandbox import (
    ExecResult,
    SandboxBroken,
    SandboxError,
    SandboxPathError,
    SandboxRequestError,
    SandboxSpec,
    SandboxUnavailable,
)
from tangram_env.server.sandbox import agentlink, fsaccess, seccomp
from tangram_env.server.sandbox.cgroups import CFS_PERIOD_US, CgroupGroup, drain, format_cpus
from tangram_env.server.sandbox.execgroups import Claim, ExecSlots
from tangram_env.server.sandbox.execspec import ExecPlan, plan_exec, result_from
from tangram_env.server.sandbox.linux import clear_sysv_ipc, is_mount_point, mount_tmpfs, unmount
from tangram_env.server.sandbox.procrun import RunOutcome, kill_session, run_captured
from tangram_env.server.sandbox.protections import Protections, host_protections, log_protections
from tangram_env.server.sandbox.stale import remove_sandbox_dir, sweep_stale
from tangram_env.server.sandbox.treecopy import copy_tree
from tangram_env.server.sandbox.uids import UidLeases
from tangram_env.server.sandbox.view import (
    TMP,
    WORKSPACE,
    SandboxUser,
    account_files,
    base_env,
    build_etc,
    bwrap_prefix,
    command_suffix,
)

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger(__name__)

#: Pseudo-terminals one sandbox may hold at once (a test suite, ``script`` or ``pexpect`` needs a few).
PTYS_PER_SANDBOX = 64
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def _children(pid: int) -> list[int]:
    """The children of ``pid``'s main thread (none if it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(child) for child in children.read().split()]
    except OSError:
        return []


def _has_devpts(pid: int) -> bool:
    """Whether ``pid``'s mount namespace has its ``/dev/pts`` mounted yet."""
    try:
        with open(f"/proc/{pid}/mounts") as mounts:
            return any(line.split()[1:3] == ["/dev/pts", "devpts"] for line in mounts)
    except OSError:
        return False


#: A command is a likelier out-of-memory victim than its sandbox's agent (and than the server).
_COMMAND_OOM_SCORE_ADJ = 500
#: What a sandbox's files always leave of its memory limit (at most half of it): its tmpfs counts
#: against the limit, and killing a process frees no file. A tmpfs as large as the limit, once a
#: command filled it, left the OOM killer only the sandbox's own agent to kill: the sandbox broke, and
#: a policy could end its episode as an infrastructure failure instead of its own.
FILES_HEADROOM_MB = 64


def files_mb(spec: SandboxSpec) -> int:
    """The size of a sandbox's tmpfs (its workspace and tmp) under a memory limit: its disk, kept
    :data:`FILES_HEADROOM_MB` (or half the limit) below the memory limit.
    """
    return max(1, min(spec.disk_mb, spec.mem_mb - min(FILES_HEADROOM_MB, spec.mem_mb // 2)))


def default_state_dir() -> str:
    """Where sandboxes live on the host: ``$TANGRAM_SANDBOX_DIR`` or a per-user folder in the temp dir."""
    return os.environ.get("TANGRAM_SANDBOX_DIR") or os.path.join(
        tempfile.gettempdir(), f"tangram-sandboxes-{os.geteuid()}"
    )


class LocalProvider:
    """Makes :class:`LocalSandbox` es; refuses to start where untrusted code could not be isolated.

    ``state_dir`` holds the sandboxes (default :func:`default_state_dir`), ``image_dir`` the images
    (default ``$TANGRAM_IMAGE_DIR`` or ``~/.cache/tangram/images``); as root, each sandbox's code runs
    as its own uid from ``uid_base .. uid_base + uid_count``.
    """

    name = "local"

    def __init__(
        self,
        *,
        state_dir: str | None = None,
        image_dir: str | None = None,
        uid_base: int = 3_000_000,
        uid_count: int = 4096,
        exec_agent: bool = True,
    ) -> None:
        self.state_dir = os.path.abspath(state_dir or default_state_dir())
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self.protections: Protections = host_protections(self.state_dir)
        log_protections(self.protections, log)
        if not self.protections.isolated:
            raise SandboxUnavailable(
                "the local sandbox cannot isolate code on this host ("
                + ("; ".join(self.protections.problems) or "bubblewrap namespaces unavailable")
                + "). Install bubblewrap, or opt out explicitly with make_provider('none') to run "
                "untrusted code without isolation."
            )
        self.image_dir = image_dir
        self.exec_agent = exec_agent and self._agent_possible()
        self._owner_pid = os.getpid()
        self.uids = UidLeases(uid_base, uid_count) if self.protections.privileged else None
        self.host_cpus = frozenset(os.sched_getaffinity(0))
        self.sandboxes: dict[str, LocalSandbox] = {}
        self.seccomp = seccomp.build_filter() if seccomp.supported() else None
        if self.seccomp is None:
            log.warning("no seccomp filter for %s: sandboxes run without one", platform.machine())
        swept = sweep_stale(self.state_dir)
        if swept:
            log.info("removed %d sandboxes left behind by a previous run", swept)
        # The /etc every sandbox of this provider sees; locked like a sandbox, so a sweep spares it.
        self.etc_dir = os.path.join(self.state_dir, f"etc-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.etc_dir, 0o755)
        self._etc_lock = os.open(
            os.path.join(self.etc_dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        fcntl.flock(self._etc_lock, fcntl.LOCK_EX)
        build_etc(self.etc_dir)
        self._closed = False

    def _agent_possible(self) -> bool:
        """Whether sandboxes can keep an exec agent: root (so the agent and the commands get different
        uids), cgroups for the sandbox and per exec (so a command is placed, and what it leaves
        behind found, from outside), and the host's interpreter to run the agent on. On v2 the
        kernel must also check a move against the credentials that opened ``cgroup.procs`` (Linux
        5.16 and the stable kernels the fix went to): the agent's child, no longer privileged on
        the host, joins its exec's group through a file the server opened.
        """
        layout = self.protections.cgroups
        return (
            self.protections.privileged
            and all(layout.has(c) for c in ("memory", "pids", "cpuacct"))
            and agentlink.available()
            and (layout.version == 1 or layout.moves_by_opener())
        )

    def seccomp_fd(self) -> int | None:
        """A fresh pipe's read end holding the seccomp filter (bubblewrap reads it once, to its end)."""
        if self.seccomp is None:
            return None
        read_fd, write_fd = os.pipe()
        try:
            os.write(write_fd, self.seccomp)  # a few hundred bytes: fits the pipe buffer
        finally:
            os.close(write_fd)
        return read_fd

    def create(self, spec: SandboxSpec) -> LocalSandbox:
        """A new sandbox from ``spec.image``, with ``spec``'s limits, ready to exec."""
        image = get_image(spec.image, self.image_dir)
        image.check_usable()
        sandbox = LocalSandbox(self, spec, image)
        self.sandboxes[sandbox.id] = sandbox
        return sandbox

    def close(self) -> None:
        """Close every sandbox this provider made, and remove what they shared."""
        for sandbox in list(self.sandboxes.values()):
            sandbox.close()
        if not self._closed and os.getpid() == self._owner_pid:
            self._closed = True
            shutil.rmtree(self.etc_dir, ignore_errors=True)
            os.close(self._etc_lock)


class LocalSandbox:
    """One isolated sandbox on this host (see the module's description)."""

    #: ``exec`` returns by its time limit, having killed its command's cgroup (see the executor).
    bounded_exec = True

    def __init__(self, provider: LocalProvider, spec: SandboxSpec, image: Image) -> None:
        self.id = f"sb-{uuid.uuid4().hex[:12]}"
        self.workspace = WORKSPACE
        self.spec = spec
        self.image = image
        self._provider = provider
        self._prot = provider.protections
        self._owner_pid = os.getpid()
        self._closed = False
        self.dir = os.path.join(provider.state_dir, self.id)
        self._fs = os.path.join(self.dir, "fs")
        self.host_workspace = os.path.join(self._fs, "work")
        self.host_tmp = os.path.join(self._fs, "tmp")
        self._uid_fd = -1
        self._lock_fd = -1
        self.agent: agentlink.AgentProcess | None = None
        self._background_name = f"{self.id}.bg"  # the group of what commands declared background
        self._helpers_name = f"{self.id}.helpers"  # the same for trusted root helpers: they outlive resets
        self.group: CgroupGroup | None = None
        self.slots = ExecSlots(self._prot.cgroups, self.id, os.path.join(self.dir, "slots"))
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # --- life cycle -------------------------------------------------------------------------------
    def _setup(self) -> None:
        os.mkdir(self.dir, 0o700)
        self._lock_fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        if self._provider.uids is not None:
            uid, self._uid_fd = self._provider.uids.lease()
            self.user = SandboxUser(uid, uid, self._prot.setpriv)
        else:
            self.user = SandboxUser(os.getuid(), os.getgid(), None)
        account_dir = os.path.join(self.dir, "etc")
        os.mkdir(account_dir, 0o755)
        for name, text in account_files(self.user).items():
            with open(os.path.join(account_dir, name), "w") as f:
                f.write(text)
        os.mkdir(self._fs, 0o700)
        layout = self._prot.cgroups
        if layout.has("memory") or layout.has("pids"):
            self.group = layout.group(self.id, ("memory", "pids"))
            self._limit_group(self.group)
        if self.slots.enabled:
            self.slots.prepare(1)
        self._write_state()
        self._fresh_files()
        self._prefix = bwrap_prefix(
            self._prot.bwrap or "bwrap",
            image=self.image,
            user=self.user,
            privileged=self._prot.privileged,
            network=self.spec.network,
            host_work=self.host_workspace,
            host_tmp=self.host_tmp,
            etc_dir=self._provider.etc_dir,
            account_dir=account_dir,
        )
        self._env = base_env(self.image, self.spec.env)
        if self._provider.exec_agent:
            self._start_agent()

    def _start_agent(self) -> None:
        """Start the sandbox's exec agent: its namespaces are made now, once, for every command."""
        assert self.group is not None
        socket_path = os.path.join(self.dir, "agent.sock")
        if len(socket_path) > 100:  # a unix socket's path has room for 107 bytes
            short = os.path.join(tempfile.gettempdir(), f"tangram-agents-{os.geteuid()}")
            os.makedirs(short, mode=0o700, exist_ok=True)
            socket_path = os.path.join(short, f"{self.id}.sock")
        self.agent = agentlink.launch(
            self._prefix,
            socket_path=socket_path,
            uid=self.user.uid,
            gid=self.user.gid,
            seccomp_fd=self._provider.seccomp_fd(),
            log_path=os.path.join(self.dir, "agent.log"),
            join_files=self._agent_group().procs_files(),
        )
        self._limit_ptys()

    def _agent_group(self) -> CgroupGroup:
        """Where the agent and its spare children live: the sandbox's own group on v1; on v2, whose
        sandbox group holds no process (it hands CPU controllers down to its execs), a leaf in it.
        """
        assert self.group is not None
        if self._prot.cgroups.version == 1:
            return self.group
        return self._prot.cgroups.group(f"{self.id}.agent", ("memory", "pids"))

    def _limit_ptys(self) -> None:
        """Cap the sandbox's pseudo-terminals at :data:`PTYS_PER_SANDBOX`: bubblewrap's ``/dev/pts`` has
        no limit of its own, and one command held all 3,071 the host's other instances share, so no
        other sandbox could open one. Remounted from the host in the sandbox's mount namespace, once
        bubblewrap has mounted it; where ``nsenter`` is missing, the sandbox goes on without the cap.
        """
        nsenter = shutil.which("nsenter")
        if nsenter is None:
            _warn_once("nsenter (util-linux) is missing: sandboxes' pseudo-terminals are not capped")
            return
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            inside = self._bwrap_child()
            # Its own child (the agent) starts once bubblewrap has made the sandbox's root.
            if inside is not None and _children(inside) and _has_devpts(inside):
                break
            time.sleep(0.002)
        else:
            log.warning(
                "sandbox %s: its /dev/pts did not appear; its pseudo-terminals are not capped", self.id
            )
            return
        options = f"remount,nosuid,noexec,mode=620,ptmxmode=666,max={PTYS_PER_SANDBOX}"
        done = subprocess.run(
            [nsenter, "-t", str(inside), "-m", "mount", "-o", options, "/dev/pts"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            log.warning(
                "sandbox %s: cannot cap its pseudo-terminals: %s", self.id, done.stderr.strip()[-200:]
            )

    def _limit_group(self, group: CgroupGroup) -> None:
        if group.has("memory"):
            limit = self.spec.mem_mb << 20
            group.write("memory", "memory.limit_in_bytes", limit)
            with contextlib.suppress(OSError):  # absent without swap accounting
                group.write("memory", "memory.memsw.limit_in_bytes", limit)
        if group.has("pids"):
            group.write("pids", "pids.max", self.spec.max_pids)

    def _write_state(self) -> None:
        state = {
            "id": self.id,
            "uid": self.user.uid,
            "fs": self._fs,
            "cgroups": self.group.paths if self.group else {},
            "cgroup_version": self._prot.cgroups.version,
        }
        state["exec_globs"] = [os.path.join(b, f"{self.id}.*") for b in self._prot.cgroups.bases.values()]
        with open(os.path.join(self.dir, "state.json"), "w") as f:
            json.dump(state, f)

    def _fresh_files(self) -> None:
        """An empty workspace and tmp, then the image's starting files."""
        uid, gid = self.user.uid, self.user.gid
        if self._prot.tmpfs:
            if is_mount_point(self._fs):
                unmount(self._fs)
            limited = self.group is not None and self.group.has("memory")
            size_mb = files_mb(self.spec) if limited else self.spec.disk_mb
            mount_tmpfs(self._fs, size_bytes=size_mb << 20, uid=uid, gid=gid, mode=0o700)
        else:
            for path in (self.host_workspace, self.host_tmp):
                if os.path.lexists(path):
                    _empty_dir(path)  # however deep a command made it
                    os.rmdir(path)
        for path in (self.host_workspace, self.host_tmp):
            os.mkdir(path, 0o700)
            os.chown(path, uid, gid)
        if self.image.workspace:
            copy_tree(self.image.workspace, self.host_workspace, uid, gid)

    def reset(self) -> None:
        """Back to the image's starting state: every process killed, workspace and tmp restored."""
        self._check_usable()
        if self.agent is not None:
            self._reset_with_agent()
            return
        if not self._kill_everything():
            self._mark_broken("processes survived SIGKILL during reset")
            raise SandboxBroken("processes survived SIGKILL during reset", self.id)
        try:
            self._fresh_files()
        except OSError as exc:
            self._mark_broken(f"reset failed: {exc}")
            raise SandboxBroken(f"reset failed: {exc}", self.id) from exc

    def _background_group(self, name: str | None = None) -> CgroupGroup:
        """The background group, or ``name`` (their directories exist once a command kept a process)."""
        layout = self._prot.cgroups
        paths = layout.paths(name or self._background_name, self.slots.controllers)
        return CgroupGroup(paths, layout.version)

    def _keep_background(self, slot: CgroupGroup, name: str | None = None) -> None:
        """Move what a command left in its exec group to the sandbox's background group, or ``name``
        (unpinned).
        """
        files = self._prot.cgroups.group(name or self._background_name, self.slots.controllers).procs_files()

        def move(pid: int) -> None:
            _write_pid(files, pid)
            os.sched_setaffinity(pid, self._provider.host_cpus)  # its command's grant is over

        if not drain(slot.pids, move):
            slot.kill_all(2.0)  # still forking faster than it can be moved: not kept

    def pin_helpers(self, cores: tuple[int, ...]) -> None:
        """Hold the trusted helpers (a warm judge, and the solutions it runs) to ``cores``, the grant of
        the grading they serve next: on them by a cpuset, or worth them by a CFS quota. A solution can
        widen its own affinity, and without this it ran on every core, taking other actions' time.
        """
        group = self._background_group(self._helpers_name)
        if cores and group.pids():  # nothing kept yet: the judge's launch runs on the grant
            _pin(group, cores)

    def stop_commands(self) -> None:
        """Kill every command running in this sandbox now (not its agent, nor what is kept in the
        background): each exec returns as killed. For an action its owner cancelled while it ran.
        """
        for group in self.slots.groups():
            if group.pids():
                group.kill_all(2.0)

    def reap_orphans(self) -> None:
        """Kill the processes of commands whose caller died mid-exec (an action's child killed at its
        deadline): with an agent they are not the caller's children, so nothing else ends them.
        """
        if self.agent is not None and not self._closed and not self.slots.reap_unclaimed():
            self._mark_broken("processes of a dead exec survived SIGKILL")

    def _reset_with_agent(self) -> None:
        """Reset keeping the agent: its mounts hold the workspace and tmp, so they are emptied in place."""
        groups = [*self.slots.groups(), self._background_group()]
        ok = all(group.kill_all() for group in groups)
        if not ok:
            self._mark_broken("processes survived SIGKILL during reset")
            raise SandboxBroken("processes survived SIGKILL during reset", self.id)
        try:
            _empty_dir(self.host_workspace)
            # Image paths under the host's /tmp (a checkout or venv there) are bound on top of this
            # /tmp, at directories bubblewrap made in it: deleting those would unmount them in the
            # sandbox (the kernel detaches a mount whose mount point is removed in another namespace).
            _empty_dir(self.host_tmp, keep=_tmp_mount_roots(self.image.host_paths()))
            for root in (self.host_workspace, self.host_tmp):
                _restore_root(root, self.user.uid, self.user.gid)
            if self.image.workspace:
                copy_tree(self.image.workspace, self.host_workspace, self.user.uid, self.user.gid)
        except OSError as exc:
            self._mark_broken(f"reset failed: {exc}")
            raise SandboxBroken(f"reset failed: {exc}", self.id) from exc
        # SysV shared memory, queues and semaphores live in the sandbox's IPC namespace, which outlives
        # its processes: a segment left behind was read by the next session, and counted against it.
        try:
            inside = self._ipc_namespace_pid()
            if inside is not None:
                clear_sysv_ipc(inside)
        except OSError as exc:
            self._mark_broken(f"reset could not empty the sandbox's IPC namespace: {exc}")
            raise SandboxBroken(f"reset could not empty the sandbox's IPC namespace: {exc}", self.id) from exc

    def _ipc_namespace_pid(self) -> int | None:
        """A process in the sandbox's own IPC namespace (the agent's bubblewrap's child), or None when
        there is none: nothing has run in it yet (or it shares this process's namespace, which a
        reset must never empty).
        """
        inside = self._bwrap_child()
        if (
            inside is None
            or os.stat(f"/proc/{inside}/ns/ipc").st_ino == os.stat("/proc/thread-self/ns/ipc").st_ino
        ):
            return None
        return inside

    def _bwrap_child(self) -> int | None:
        """The first process bubblewrap made in the sandbox's namespaces (None: not yet, or gone)."""
        assert self.agent is not None
        first = _children(self.agent.proc.pid)[:1]
        return first[0] if first else None

    def close(self) -> None:
        """Kill everything, unmount and delete the sandbox, give its uid back. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.agent is not None and os.getpid() == self._owner_pid:
            self.agent.stop()
        self._kill_everything()
        self._background_group().remove()
        self._background_group(self._helpers_name).remove()
        self.slots.remove_all()
        if self.group is not None:
            self.group.remove()
        remove_sandbox_dir(self.dir, self._fs)
        if self._uid_fd >= 0:
            UidLeases.release(self._uid_fd)
            self._uid_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._provider.sandboxes.pop(self.id, None)

    @property
    def slow_reset(self) -> bool:
        """Whether reset copies files (the image has a workspace): a pool may run it in a child."""
        return bool(self.image.workspace)

    def health(self, settle_s: float = 0.0) -> str | None:
        """None if the sandbox can be used, else why not (it was closed, or marked broken). ``settle_s``:
        after a command died unexplained, how long an exec agent that may have just been killed has to
        show it (see ``AgentProcess.alive``).
        """
        if self._closed or not os.path.isdir(self.dir):
            return "closed"
        if self.agent is not None and os.getpid() == self._owner_pid and not self.agent.alive(settle_s):
            self._mark_broken("the exec agent exited")
        try:
            with open(os.path.join(self.dir, "broken")) as f:
                return f.read() or "broken"
        except FileNotFoundError:
            return None

    def _mark_broken(self, reason: str) -> None:
        # Closed under a running command (the server stopping, its client gone), a sandbox dies as
        # asked: no warning for that.
        log.log(
            logging.DEBUG if self._closed else logging.WARNING, "sandbox %s is broken: %s", self.id, reason
        )
        with contextlib.suppress(OSError), open(os.path.join(self.dir, "broken"), "w") as f:
            f.write(reason)

    def _check_usable(self) -> None:
        problem = self.health()
        if problem is not None:
            raise SandboxBroken(problem, self.id)

    def _kill_everything(self) -> bool:
        ok = True
        if self.group is not None:
            ok = self.group.kill_all()
        for claim_group in self.slots.groups():
            ok = claim_group.kill_all() and ok
        return ok

    # --- files ------------------------------------------------------------------------------------
    def _locate(self, path: str) -> tuple[str, str]:
        """(host directory, relative path) for a sandbox path in the workspace or tmp."""
        for inner, host in ((WORKSPACE, self.host_workspace), (TMP, self.host_tmp)):
            if path == inner or path.startswith(inner + "/"):
                return host, path[len(inner) + 1 :]
        if path.startswith("/"):
            raise SandboxPathError(
                f"{path!r} is outside the sandbox's workspace and tmp (read-only or absent)"
            )
        return self.host_workspace, path

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` at ``path`` (relative: under the workspace; absolute: in /workspace or /tmp)."""
        self._check_usable()
        root, rel = self._locate(path)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        try:
            fsaccess.write_beneath(root, rel, payload, owner=(self.user.uid, self.user.gid))
        except OSError as exc:
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(f"cannot write {path!r} in sandbox {self.id}: {exc}") from exc

    def host_path(self, path: str) -> str:
        """Where ``path`` (in the workspace or tmp) is on the host: a unix socket a tool binds there
        is one that processes in the sandbox can reach, and the host too.
        """
        root, rel = self._locate(path)
        return os.path.join(root, rel)

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The bytes at ``path`` (FileNotFoundError if absent; links are never followed)."""
        self._check_usable()
        root, rel = self._locate(path)
        return fsaccess.read_beneath(root, rel, max_bytes)

    # --- commands ---------------------------------------------------------------------------------
    def exec(
        self,
        cmd: str | list[str],
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cores: tuple[int, ...] = (),
        stdin: bytes | None = None,
        *,
        background: bool = False,
        as_root: bool = False,
    ) -> ExecResult:
        """Run ``cmd`` in the sandbox on exactly ``cores`` (if given), within the spec's limits.

        ``background``: processes the command leaves running when its first process exits are kept
        (a server a tool starts for later commands), unpinned and holding no cores, until the
        sandbox is reset or closed; otherwise they are killed. Needs the exec agent.
        ``as_root``: the command runs as the sandbox's root with the agent's few capabilities, out of
        reach of the sandbox's user (a trusted tool's own helper, never agent code). Needs the agent.
        With ``background`` too, what it leaves running outlives resets (it must hold nothing of a
        session: the ``code`` env's judge) and ends when the sandbox closes.
        """
        plan = plan_exec(self.spec, cmd, timeout_s, cores, self._provider.host_cpus, cwd, WORKSPACE)
        if as_root and self.agent is None:
            raise SandboxRequestError("commands as the sandbox's root need the sandbox's exec agent")
        if background and self.agent is None:
            raise SandboxRequestError(
                "background processes need the sandbox's exec agent (root, cgroups, /usr/bin/python3); "
                "this sandbox starts a bubblewrap per command, whose processes end with it"
            )
        self._check_usable()
        env_all = {**self._env, **(env or {}), **plan.core_env}
        try:
            claim = self._claim_slot(plan)
        except OSError as exc:
            self._mark_broken(f"cannot set up the exec's cgroup: {exc}")
            raise SandboxBroken(f"cannot set up the exec's cgroup: {exc}", self.id) from exc
        group = claim.group if claim else None
        before = self._counters()
        if self.agent is not None:
            assert claim is not None, "a sandbox with an agent has exec slots"
            outcome = self._exec_by_agent(plan, env_all, stdin, claim, background, as_root)
            used_ns = int(claim.group.read("cpuacct", "cpuacct.usage") or 0)
            self.slots.release(claim)
            outcome.cpu_s = used_ns / 1e9
            after = self._counters()
            return result_from(outcome, self.spec, oom=after[0] > before[0], pids_max=after[1] > before[1])
        filter_fd = self._provider.seccomp_fd()
        try:
            outcome = run_captured(
                lambda status_fd, block_fd: self._command(plan, status_fd, block_fd, filter_fd),
                env=env_all,
                cwd="/",
                stdin=stdin.encode() if isinstance(stdin, str) else stdin,
                timeout_s=plan.timeout_s,
                max_output_bytes=self.spec.max_output_bytes,
                output_kill_bytes=self.spec.output_kill_bytes,
                kill=self._killer(group),
                on_spawn=self._join_sandbox_group,
                on_child=self._attacher(group, plan),
                give_fds=(filter_fd,) if filter_fd is not None else (),
            )
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            self._mark_broken(f"could not start the sandbox: {exc}")
            raise SandboxBroken(f"could not start the sandbox: {exc}", self.id) from exc
        finally:
            cpu_ns = None
            if group is not None and group.has("cpuacct"):
                cpu_ns = int(group.read("cpuacct", "cpuacct.usage") or 0)
            if claim is not None:
                self.slots.release(claim)
        if _failed_to_start(outcome):
            reason = outcome.stderr.decode(errors="replace").strip()[:500] or f"exit {outcome.returncode}"
            self._mark_broken(f"could not start the command: {reason}")
            raise SandboxBroken(f"could not start the command: {reason}", self.id)
        if cpu_ns is not None:
            outcome.cpu_s = cpu_ns / 1e9
        after = self._counters()
        return result_from(outcome, self.spec, oom=after[0] > before[0], pids_max=after[1] > before[1])

    def _exec_by_agent(
        self,
        plan: ExecPlan,
        env: dict[str, str],
        stdin: bytes | str | None,
        claim: Claim,
        background: bool,
        as_root: bool = False,
    ) -> RunOutcome:
        """Run ``plan`` through the agent, in ``claim``'s group (SandboxBroken if the agent is lost)."""
        assert self.agent is not None
        group = claim.group
        placement = agentlink.Placement(
            join_files=group.join_files(_exec_controllers(group, plan)),
            cores=plan.cores,
            rlimits=plan.rlimits(privileged=True, cgroup_memory=True),
            oom_score_adj=_COMMAND_OOM_SCORE_ADJ,
        )

        try:
            return agentlink.run_command(
                self.agent.socket_path,
                argv=plan.argv,
                env=env,
                cwd=plan.cwd,
                stdin=stdin.encode() if isinstance(stdin, str) else stdin,
                timeout_s=plan.timeout_s,
                max_output_bytes=self.spec.max_output_bytes,
                output_kill_bytes=self.spec.output_kill_bytes,
                placement=placement,
                kill=functools.partial(group.kill_all, 2.0),
                on_exit=(
                    functools.partial(self._keep_background, group, self._helpers_name if as_root else None)
                    if background
                    else None
                ),
                as_root=as_root,
            )
        except (agentlink.AgentLost, OSError) as exc:
            group.kill_all(2.0)
            self.slots.release(claim)
            reason = f"{exc}{self._agent_log_tail()}"
            self._mark_broken(reason)
            raise SandboxBroken(reason, self.id) from exc
        except BaseException:
            group.kill_all(2.0)
            self.slots.release(claim)
            raise

    def _agent_log_tail(self) -> str:
        """The last words of the agent's bubblewrap (why it would not start, say), to add to a reason."""
        try:
            with open(os.path.join(self.dir, "agent.log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 300))
                tail = f.read().decode(errors="replace").strip()
        except OSError:
            return ""
        return f" ({tail})" if tail else ""

    def _counters(self) -> tuple[int, int]:
        """(OOM kills, forks refused at the pids limit) so far in this sandbox."""
        if self.group is None:
            return 0, 0
        oom = (
            self.group.counter("memory", "memory.oom_control", "oom_kill") if self.group.has("memory") else 0
        )
        pids = self.group.counter("pids", "pids.events", "max") if self.group.has("pids") else 0
        return oom, pids

    def _command(self, plan: ExecPlan, status_fd: int, block_fd: int, filter_fd: int | None) -> list[str]:
        # setpriv first: bubblewrap dies with the thread that started it (an executor child killed
        # at its deadline takes its sandboxed command with it).
        guard = [self._prot.setpriv, "--pdeathsig", "KILL", "--"] if self._prot.setpriv else []
        sync = ["--json-status-fd", str(status_fd), "--block-fd", str(block_fd)]
        if filter_fd is not None:
            sync += ["--seccomp", str(filter_fd)]
        return [*guard, *self._prefix, *sync, *command_suffix(self.user, plan.cwd, plan.argv)]

    def _claim_slot(self, plan: ExecPlan) -> Claim | None:
        """A per-exec group: it counts the exec's CPU time and, on granted cores, pins and caps it."""
        claim = self.slots.claim()
        if claim is None:
            return None
        group = claim.group
        try:
            if plan.cores:
                _pin(group, plan.cores)
            elif group.version == 2:
                # On v2 a slot's one group both counts and pins: the last pinned exec's cores (or quota)
                # would hold this unpinned one. Empty is the parent's CPUs; -1 no quota.
                if group.has("cpuset"):
                    group.write("cpuset", "cpuset.cpus", "\n")
                if group.has("cpu"):
                    group.write("cpu", "cpu.cfs_quota_us", -1)
            if group.has("cpuacct"):
                group.write("cpuacct", "cpuacct.usage", 0)
        except OSError:
            self.slots.release(claim)
            raise
        return claim

    def _join_sandbox_group(self, pid: int) -> None:
        """Move bubblewrap itself into the sandbox's memory and pids groups, as soon as it exists.

        Not needed for the limits (its first child is moved before it runs) but for speed: the
        first move into a v1 cgroup after a quiet spell waits for an RCU grace period (several
        milliseconds); paying it here overlaps bubblewrap's own set-up instead of following it.
        """
        if self.group is not None:
            _write_pid(self.group.procs_files(), pid)

    def _attacher(self, group: CgroupGroup | None, plan: ExecPlan) -> Callable[[int], None]:
        """Put the sandbox's first process (still waiting, as root) under every limit, before it runs."""
        files = self.group.procs_files() if self.group else []
        if group is not None:
            # Unpinned execs stay in the server's cpuset and quota; they join only the usage counter
            # (on v2 the same group, whose pin _claim_slot lifted).
            files += group.procs_files(_exec_controllers(group, plan))
        memory = bool(self.group and self.group.has("memory"))
        rlimits = plan.rlimits(privileged=self._prot.privileged, cgroup_memory=memory)

        def attach(pid: int) -> None:
            _write_pid(files, pid)
            if plan.cores:
                os.sched_setaffinity(pid, plan.cores)
            for which, value in rlimits:
                resource.prlimit(pid, which, value)

        return attach

    def _killer(self, group: CgroupGroup | None) -> Callable[[int], None]:
        def kill(pid: int) -> None:
            if group is not None:
                group.kill_all(0.5)
            kill_session(pid)

        return kill

    def __repr__(self) -> str:
        return f"LocalSandbox({self.id}, image={self.image.name!r}, uid={self.user.uid})"


def _failed_to_start(outcome: RunOutcome) -> bool:
    """Whether bubblewrap (or setpriv after it) failed before the command ran.

    They exit 1 (setpriv: 127) with their name first on stderr. Sandboxed code can print the same
    to fake it; all that buys it is a fresh sandbox of its own.
    """
    if outcome.timed_out or outcome.output_exceeded:
        return False
    if b'"child-pid"' not in outcome.status:
        return True
    return outcome.returncode in (1, 127) and outcome.stderr.startswith((b"bwrap: ", b"setpriv: "))


def _pin(group: CgroupGroup, cores: tuple[int, ...]) -> None:
    """Hold what runs in ``group`` to ``cores``: on them by a cpuset, or worth them by a CFS quota
    (one period per core) where there is no cpuset.
    """
    if group.has("cpuset"):
        group.write("cpuset", "cpuset.cpus", format_cpus(cores))
    elif group.has("cpu"):
        group.write("cpu", "cpu.cfs_period_us", CFS_PERIOD_US)
        group.write("cpu", "cpu.cfs_quota_us", CFS_PERIOD_US * len(cores))


def _exec_controllers(group: CgroupGroup, plan: ExecPlan) -> tuple[str, ...]:
    """The per-exec controllers a command joins.

    Every command is counted (``cpuacct``); one on granted cores is held to exactly them by a
    ``cpuset``, or where there is none, capped to their worth by a CFS quota (``cpu``). Never both:
    a cpuset already bounds the time to its cores, and a ``cpu`` group would make the command share
    one group's weight with every other sandbox's on a busy host (its granted core diluted).
    Unpinned commands stay in the server's cpuset and quota.
    """
    if not plan.cores:
        return ("cpuacct",)
    return ("cpuacct", "cpuset") if group.has("cpuset") else ("cpuacct", "cpu")


def _tmp_mount_roots(host_paths: list[str]) -> frozenset[str]:
    """The names directly under ``/tmp`` that lead to image paths bound there."""
    prefix = TMP + "/"
    return frozenset(p[len(prefix) :].split("/")[0] for p in host_paths if p.startswith(prefix))


def _empty_dir(path: str, keep: frozenset[str] = frozenset()) -> None:
    """Delete what is in ``path`` (never following links) but the entries named in ``keep``, keeping
    the directory itself.

    Iterative, and at most two directories open at once, however deep the tree: a subdirectory is
    moved up into ``path`` under a name of its own and deleted from there (a recursive delete ran out
    of Python's stack, or of path length, on a tree a command made 5,000 levels deep).
    """
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        with os.scandir(top) as entries:
            todo = [e.name for e in entries if e.name not in keep]
        while todo:
            name = todo.pop()
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
            except NotADirectoryError:  # a file, or a link (O_NOFOLLOW): unlinked, never followed
                os.unlink(name, dir_fd=top)
                continue
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            up = f".tangram-reset-{secrets.token_hex(8)}"  # no name of the tree's
                            os.rename(entry.name, up, src_dir_fd=fd, dst_dir_fd=top)
                            todo.append(up)
                        else:
                            os.unlink(entry.name, dir_fd=fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)


def _restore_root(path: str, uid: int, gid: int) -> None:
    """Put back the attributes of a directory a reset empties in place: a command may have changed
    its mode (``chmod 000 /workspace`` broke every later command), left extended attributes on it (a
    message to the next session) or set its times.
    """
    for name in os.listxattr(path, follow_symlinks=False):
        os.removexattr(path, name, follow_symlinks=False)
    os.chown(path, uid, gid, follow_symlinks=False)
    os.chmod(path, 0o700, follow_symlinks=False)
    os.utime(path, follow_symlinks=False)


def _write_pid(files: list[str], pid: int) -> None:
    text = str(pid).encode()
    for path in files:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)
