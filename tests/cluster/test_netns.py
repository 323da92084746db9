"""Scale-out across network namespaces: one orchestrator in the root namespace, three workers each in a
namespace of its own, two trainers. Mid-run one worker is cut off the network and brought back (it must
register again and get work), another is killed, and a new one joins from a fourth namespace."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tangram_env import Client
from tangram_env.errors import ServerUnavailable
from tangram_env.server.security import keygen, read_public_key
from tests.cluster.netns import Cluster
from tests.cluster.procs import (
    Processes,
    TrainerRun,
    check_observability,
    child_env,
    free_port,
    start_orchestrator,
    start_worker,
    wait_for,
)


def test_namespaces_are_private(netns_cluster: Cluster) -> None:
    """Hosts reach the bridge and each other, and nothing else: no default route leaves a namespace."""
    a, b = netns_cluster.hosts[:2]
    for host in (a, b):
        routes = host.run(["ip", "-4", "route"]).stdout
        assert "default" not in routes and str(netns_cluster.subnet) in routes
    probe = (
        "import socket,sys; s=socket.socket(); s.settimeout(3)\n"
        "try: s.connect((sys.argv[1], 9))\n"
        "except ConnectionRefusedError: print('refused')\n"
        "except OSError as e: print('unreachable', e)\n"
    )
    assert (
        a.run(["python3", "-c", probe, netns_cluster.gateway]).stdout.strip() == "refused"
    )  # root ns answers
    assert a.run(["python3", "-c", probe, b.address]).stdout.strip() == "refused"
    netns_cluster.cut(a)
    assert a.run(["python3", "-c", probe, netns_cluster.gateway]).stdout.startswith("unreachable")
    netns_cluster.restore(a)
    wait_for(
        lambda: a.run(["python3", "-c", probe, netns_cluster.gateway]).stdout.strip() == "refused",
        10,
        "the restored link to carry traffic",
        every_s=0.2,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_in_namespaces_cut_killed_and_added(
    netns_cluster: Cluster,
    procs: Processes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    net = netns_cluster
    # A non-loopback bind is authenticated: CurveZMQ keys, the public half given to every peer.
    public, secret = keygen(str(tmp_path / "keys"))
    server_key = read_public_key(str(public))
    monkeypatch.setenv("TANGRAM_CURVE_SERVER_KEY", server_key)  # workers, trainers and `stats` inherit it
    env = child_env(TANGRAM_SERVER_WORKER_TIMEOUT_S="2s")
    metrics_port = free_port()
    _, address = start_orchestrator(
        procs,
        f"tcp://{net.gateway}:0",
        "--allow-remote",
        "--curve-secret-key-file",
        str(secret),
        "--metrics-port",
        str(metrics_port),
        env=env,
    )
    assert address.startswith(f"tcp://{net.gateway}:")
    monkeypatch.delenv("TANGRAM_CURVE_SERVER_KEY")
    with pytest.raises(ServerUnavailable):  # without the key nobody gets in
        Client(address, connect_timeout_s=1.0)
    monkeypatch.setenv("TANGRAM_CURVE_SERVER_KEY", server_key)
    workers = {f"w{i}": start_worker(procs, address, f"w{i}", host=net.hosts[i]) for i in range(3)}
    with Client(address) as client:
        run = TrainerRun(procs, client, address, tmp_path)

        def busy(*names: str) -> bool:
            figures = client.stats()
            return figures["finished"] >= run.N_PER_TRAINER // 4 and all(
                figures["workers"][n]["running"] >= 1 for n in names
            )

        wait_for(lambda: busy("w0", "w1"), 40, "w0 and w1 to be busy mid-run", every_s=0.02)
        net.cut(net.hosts[0])  # w0 stays alive, unplugged
        os.kill(workers["w1"].pid, signal.SIGKILL)
        workers["w1"].wait()
        start_worker(procs, address, "w3", host=net.add_host())
        wait_for(
            lambda: not {"w0", "w1"} & set(client.stats()["workers"]), 20, "w0 and w1 to be declared lost"
        )
        net.restore(net.hosts[0])
        wait_for(
            lambda: {"w0", "w3"} <= set(client.stats()["workers"]),
            40,
            "w0 to register again after its link came back, and w3 to join",
        )
        back_at = time.time()
        run.second_half()  # on the changed cluster
        figures = client.stats()
        check_observability(metrics_port, address, 2 * run.N_PER_TRAINER, {"local", "w0", "w2", "w3"}, capsys)

    seen, done = run.check(figures, faulty={"w0", "w1"}, workers={"local", "w0", "w2", "w3"})
    # The worker that was cut off serves again: results of runs it finished after it came back.
    after = [
        r
        for r in run.records
        if r["worker"] == "w0" and max(t for w, t in done[r["id"]] if w == "w0") > back_at
    ]
    assert after, seen
