"""Private network namespaces for cluster tests: one bridge in the root namespace, one veth per host.

    with Cluster.create(3) as net:                 # namespaces tgc<id>-0..2 on a private /24
        net.hosts[0].popen([...])                  # a process inside host 0's namespace
        net.cut(net.hosts[0]); net.restore(net.hosts[0])

Everything lives in names and addresses this module creates: a bridge ``tgb<id>`` holding the first
address of a /24 taken from 10.200.0.0/13 (one no route on this machine already covers), and for each
host a namespace with a veth pair whose inside end holds the next address. No forwarding, NAT or
default route is added, so nothing in a namespace can reach past the bridge. ``close`` (also run on
exceptions and at interpreter exit) deletes what was made, and stale objects of dead earlier runs are
swept before a new cluster is built.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_PREFIX = "tgc"  # namespaces tgc<pid>x<n>-<i>; bridges tgb<pid>x<n>; veths tgv<pid>x<n>i<i>
_SUPERNET = ipaddress.IPv4Network("10.200.0.0/13")
_counter = 0


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or no ``ip`` tool)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _forwarding(bridge: str, action: str) -> None:
    """Insert (``-I``) or delete (``-D``) a rule letting traffic cross ``bridge``: where a Docker engine
    runs, bridged packets pass the host's iptables, whose FORWARD policy Docker sets to DROP.
    """
    if shutil.which("iptables") is not None:
        rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
        subprocess.run(["iptables", "-w", action, *rule], capture_output=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip tool (iproute2) is not installed"
    probe = f"{_PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> None:
    """Delete namespaces, bridges and veths left by test runs whose process is gone."""
    owner = re.compile(rf"^{_PREFIX}(\d+)x")
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = owner.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
    links = re.compile(r"^\d+:\s+(tg[bv](\d+)x[^:@\s]*)")
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = links.match(line)
        if m and not _pid_alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 inside the private supernet that no address or route of the root namespace touches."""
    used: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        token = line.split()[0] if line.split() else ""
        if (
            token in ("local", "broadcast", "unreachable", "blackhole", "prohibit", "throw")
            and len(line.split()) > 1
        ):
            token = line.split()[1]
        try:
            net = ipaddress.ip_network(token if token != "default" else "0.0.0.0/0", strict=False)
        except ValueError:
            continue
        if net.prefixlen > 0:  # the default route covers everything and says nothing
            used.append(net)
    for line in _ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            iface = ipaddress.ip_interface(parts[parts.index("inet") + 1])
            used.append(iface.network)
    # Start at an offset drawn from the pid so that parallel runs rarely probe the same block first.
    candidates = list(_SUPERNET.subnets(new_prefix=24))
    start = os.getpid() % len(candidates)
    for block in candidates[start:] + candidates[:start]:
        if not any(block.overlaps(u) for u in used):
            return block
    raise RuntimeError(f"no free /24 left in {_SUPERNET}")


@dataclass
class Host:
    """One network namespace joined to the bridge by a veth pair."""

    name: str
    address: str  # inside the namespace
    host_veth: str  # root-namespace end (on the bridge): setting it down cuts the host off

    def cmd(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace (``ip netns exec`` execs it, so its pid is the command's)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this namespace."""
        return subprocess.Popen(self.cmd(argv), **kwargs)

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this namespace to completion."""
        return subprocess.run(self.cmd(argv), capture_output=True, text=True, timeout=30, **kwargs)


@dataclass
class Cluster:
    """A bridge in the root namespace and the hosts attached to it."""

    tag: str
    subnet: ipaddress.IPv4Network
    bridge: str
    gateway: str  # the bridge's address: what root-namespace servers bind
    hosts: list[Host] = field(default_factory=list)
    _closed: bool = False

    @classmethod
    def create(cls, n_hosts: int) -> Cluster:
        """Build a bridge and ``n_hosts`` namespaces; on any failure, remove what was built and raise."""
        global _counter
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        sweep_stale()
        _counter += 1
        tag = f"{os.getpid()}x{_counter}"
        subnet = _free_subnet()
        addrs = list(subnet.hosts())
        net = cls(tag=tag, subnet=subnet, bridge=f"tgb{tag}", gateway=str(addrs[0]))
        atexit.register(net.close)
        try:
            _ip("link", "add", net.bridge, "type", "bridge")
            # An address of its own, set: otherwise the bridge takes its lowest port's, and a host
            # joining with a lower one changes it mid-run, so that every other host's cached entry
            # for the gateway points nowhere for seconds (a worker then misses its heartbeats).
            _ip("link", "set", net.bridge, "address", "02:" + ":".join(f"{b:02x}" for b in os.urandom(5)))
            _forwarding(net.bridge, "-I")
            _ip("addr", "add", f"{net.gateway}/{subnet.prefixlen}", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
            for _ in range(n_hosts):
                net.add_host()
        except BaseException:
            net.close()
            raise
        return net

    def add_host(self) -> Host:
        """One more namespace on the bridge (hosts can join a running cluster)."""
        i = len(self.hosts)
        addrs = list(self.subnet.hosts())
        host = Host(
            name=f"{_PREFIX}{self.tag}-{i}", address=str(addrs[1 + i]), host_veth=f"tgv{self.tag}i{i}"
        )
        inner = f"tgv{self.tag}p{i}"
        self.hosts.append(host)  # recorded first: close() removes it even if a step below fails
        _ip("netns", "add", host.name)
        _ip("link", "add", host.host_veth, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", host.name)
        _ip("link", "set", host.host_veth, "master", self.bridge)
        _ip("link", "set", host.host_veth, "up")
        _ip("-n", host.name, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", inner)
        _ip("-n", host.name, "link", "set", inner, "up")
        _ip("-n", host.name, "link", "set", "lo", "up")
        return host

    def cut(self, host: Host) -> None:
        """Unplug ``host``: its packets go nowhere (connections stall; nothing is reset)."""
        _ip("link", "set", host.host_veth, "down")

    def restore(self, host: Host) -> None:
        """Plug ``host`` back in."""
        _ip("link", "set", host.host_veth, "up")

    def close(self) -> None:
        """Delete every namespace, veth and the bridge (idempotent; errors are ignored)."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            _ip("link", "del", host.host_veth, check=False)  # deletes its peer too
            _ip("netns", "del", host.name, check=False)
        _ip("link", "del", self.bridge, check=False)
        _forwarding(self.bridge, "-D")
        atexit.unregister(self.close)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
