"""What a local sandbox sees: the bubblewrap command line and the environment of its commands.

Inside, ``/`` is an empty read-only tree holding only the system directories (``/usr`` and its
links), a short list of harmless ``/etc`` files, the image's Python prefixes (read-only; their editable
installs' import hooks blanked, see :func:`editable_hooks`), a fresh
``/proc`` and ``/dev``, and two writable places of its own: ``/workspace`` and ``/tmp``. Nothing
else of the host (``/root``, ``/home``, the project, other sandboxes) exists there.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from tangram_env.images import Image

WORKSPACE = "/workspace"
TMP = "/tmp"
#: Top-level system entries, bound read-only (or recreated as the same symlink, on merged-/usr hosts).
SYSTEM_ENTRIES = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: /etc entries programs need that hold no secrets (never shadow, ssh, pip/npm/git configs).
ETC_ENTRIES = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf", "debian_version", "gai.conf",
    "host.conf", "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "magic", "magic.mime",
    "mime.types", "nsswitch.conf", "os-release", "profile", "protocols", "python3", "services", "shells",
    "ssl/certs", "ssl/openssl.cnf", "terminfo", "timezone",
)  # fmt: skip
_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class SandboxUser:
    """Who sandboxed code runs as (a leased uid when the server is root; the caller's own otherwise)."""

    uid: int
    gid: int
    drop_with: str | None  # setpriv, when bubblewrap runs as root and must drop to uid


def account_files(user: SandboxUser) -> dict[str, str]:
    """The sandbox's own /etc/passwd and /etc/group: an account for its user, and root."""
    return {
        "passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"sandbox:x:{user.uid}:{user.gid}:sandbox:{WORKSPACE}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsandbox:x:{user.gid}:\nnogroup:x:65534:\n",
    }


def build_etc(target: str, hostname: str = "sandbox") -> None:
    """Fill ``target`` with the /etc sandboxes see: copies of :data:`ETC_ENTRIES` and loopback-only hosts.

    One directory bound once costs far less per exec than a bind per file.
    """
    os.makedirs(target, mode=0o755, exist_ok=True)
    os.chmod(target, 0o755)
    for name in ETC_ENTRIES:
        source, dest = f"/etc/{name}", os.path.join(target, name)
        if not os.path.lexists(source):
            continue
        os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True)
        elif os.path.islink(source):
            os.symlink(os.readlink(source), dest)
        else:
            shutil.copy2(source, dest)
    generated = {
        "hosts": f"127.0.0.1 localhost {hostname}\n::1 localhost ip6-localhost\n",
        "hostname": f"{hostname}\n",
        "passwd": "",  # mount points for each sandbox's own account files
        "group": "",
        "resolv.conf": "",  # and for the host's, bound where the spec allows network
    }
    for name, text in generated.items():
        with open(os.path.join(target, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(target, name), 0o644)


def _system_args() -> list[str]:
    args: list[str] = []
    for name in SYSTEM_ENTRIES:
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _covered(path: str) -> bool:
    """Whether ``path`` is already visible through a system entry."""
    return any(path == f"/{n}" or path.startswith(f"/{n}/") for n in SYSTEM_ENTRIES if os.path.isdir(f"/{n}"))


def _parents(path: str) -> list[str]:
    """The ancestors of ``path`` below ``/``, outermost first."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def editable_hooks(image: Image) -> list[str]:
    """The ``.pth`` files of editable installs in the image's Python environments.

    Each points at a source tree on the host that sandboxes cannot see, and importing its finder
    (``pathlib``, ``re`` and the rest) doubles the start-up of every interpreter; sandboxes see them
    empty, so ``python3`` there starts as fast as a plain one.
    """
    hooks: list[str] = []
    for prefix in dict.fromkeys(p for p in (image.python, image.python_base) if p):
        pattern = os.path.join(prefix, "lib", "python3*", "site-packages", "__editable__*.pth")
        hooks += sorted(glob.glob(pattern))
    return hooks


def bwrap_prefix(
    bwrap: str,
    *,
    image: Image,
    user: SandboxUser,
    privileged: bool,
    network: bool,
    host_work: str,
    host_tmp: str,
    etc_dir: str,
    account_dir: str,
) -> list[str]:
    """The part of the bubblewrap command line that is the same for every exec of one sandbox."""
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--hostname", "sandbox"]
    if not network:
        args.append("--unshare-net")
    if not privileged:
        args.append("--unshare-user")
    args += _system_args()
    # The private workspace and /tmp first: an image path under the host's /tmp (a checkout or venv
    # there) is then bound read-only on top of the private /tmp instead of being hidden by it.
    args += ["--bind", host_work, WORKSPACE, "--bind", host_tmp, TMP]
    made: set[str] = set()
    for path in image.host_paths():
        if _covered(path):
            continue
        # Directories bubblewrap would make on the way are private (0700) otherwise.
        for parent in _parents(path):
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", path, path]
    for hook in editable_hooks(image):
        args += ["--ro-bind", "/dev/null", hook]
    args += ["--ro-bind", etc_dir, "/etc"]
    for name in ("passwd", "group"):
        args += ["--ro-bind", os.path.join(account_dir, name), f"/etc/{name}"]
    if network and os.path.exists("/etc/resolv.conf"):
        args += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--dir", "/var", "--symlink", "../tmp", "/var/tmp"]
    args += ["--remount-ro", "/"]
    if privileged:
        # Root inside only long enough for setpriv to drop to the sandbox's uid (searching the
        # private workspace, owned by that uid, to enter it first).
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_READ_SEARCH"):
            args += ["--cap-add", cap] if cap != "CAP_SETUID" else ["--cap-drop", "ALL", "--cap-add", cap]
    return args


def command_suffix(user: SandboxUser, cwd: str, argv: Sequence[str]) -> list[str]:
    """The per-exec tail of the command line: working directory, then the command (as the sandbox's user)."""
    args = ["--chdir", cwd, "--"]
    if user.drop_with:
        args += [user.drop_with, f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"]
        args += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return args + list(argv)


def base_env(image: Image, extra: dict[str, str]) -> dict[str, str]:
    """The environment every exec starts from (nothing of the server's own environment leaks in)."""
    env = {
        "PATH": ":".join([*image.bin_dirs(), _BASE_PATH]),
        "HOME": WORKSPACE,
        "TMPDIR": TMP,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "LANG": "C.UTF-8",
        "TANGRAM_SANDBOX": "1",
    }
    env.update(image.env)
    env.update(extra)
    return env
