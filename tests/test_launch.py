"""A server that cannot start says why at once, through the launcher and the embedded orchestrator."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tangram_env
from tangram_env import launch
from tangram_env.errors import ServerUnavailable
from tests.conftest import ROOT, ServerProcess


def test_the_cause_and_fix_arrive_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"could not start: .*no sandbox provider named 'dockr'"):
        ServerProcess("--sandbox", "dockr")
    assert time.monotonic() - started < 30  # not the 60 s start timeout


def test_a_missing_docker_engine_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("docker")
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(ServerUnavailable, match=r"no Docker engine answers here.*dockerd"):
        ServerProcess("--sandbox", "docker")


def test_bad_settings_are_named() -> None:
    with pytest.raises(ServerUnavailable, match=r"invalid settings: .*max_retries"):
        launch.ServerProcess(env={**os.environ, "TANGRAM_SERVER_MAX_RETRIES": "-1"}, cwd=ROOT)


def test_a_plugin_module_off_the_path_is_named_with_the_fix(tmp_path: Path) -> None:
    # `tangram-server --plugin mypkg.tools` from the folder holding mypkg/: console scripts do not put
    # the working directory on the path, and "No module named 'mypkg'" said nothing of that.
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "tools.py").write_text("import a_dependency_that_is_missing\n")
    said = r"--plugin mypkg.tools: cannot import it: No module named 'mypkg' .*set PYTHONPATH to the folder"
    with pytest.raises(ServerUnavailable, match=said):
        launch.ServerProcess(
            "--plugin", "mypkg.tools", env=dict(os.environ), cwd=ROOT
        )  # `-m`: cwd on the path
    # Found, but something it imports is missing: that is what is named.
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    with pytest.raises(ServerUnavailable, match=r"No module named 'a_dependency_that_is_missing'"):
        launch.ServerProcess("--plugin", "mypkg.tools", env=env, cwd=tmp_path)


def test_the_embedded_orchestrator_carries_the_cause() -> None:
    # A fresh process, so that its embedded orchestrator starts with this environment.
    code = (
        "import tangram_env\n"
        "env = tangram_env.make('code')\n"
        "try:\n"
        "    env.reset()\n"
        "    env.step('def f(): pass')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_ADDRESS"}
    env["TANGRAM_SERVER_SANDBOX_PROVIDER"] = "no-such-provider"
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert (
        "ServerUnavailable" in out.stdout and "no sandbox provider named 'no-such-provider'" in out.stdout
    ), out.stdout + out.stderr
    assert "embedded orchestrator" in out.stdout and time.monotonic() - started < 60


def _embedded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("TANGRAM_ADDRESS", "PYTHONSAFEPATH")}


def test_the_embedded_orchestrator_imports_the_modules_this_process_imported(tmp_path: Path) -> None:
    # `python ../proj/train.py` from another folder: `import tools` is proj/tools.py here, and must be
    # there too, not the working directory's tools.py (which `python -m` would put first).
    proj, cwd = tmp_path / "proj", tmp_path / "cwd"
    proj.mkdir()
    cwd.mkdir()
    (cwd / "tools.py").write_text("raise ImportError('the working directory tools.py was imported')\n")
    (proj / "tools.py").write_text(
        "import os\n"
        "from pydantic import BaseModel\n"
        "import tangram_env\n\n"
        "class N(BaseModel):\n"
        "    n: int\n\n"
        "@tangram_env.tool(name='proj.double', cpu=0.1, mem_mb=16, timeout_s=10)\n"
        "def double(args: N) -> list:\n"
        "    return [args.n * 2, os.environ.get('PYTHONSAFEPATH')]\n"
    )
    (proj / "train.py").write_text(
        "import tools\n"
        "import tangram_env\n"
        "with tangram_env.Client() as c:\n"
        "    print('result', c.call('proj.double', {'n': 21}))\n"
    )
    out = subprocess.run(
        [sys.executable, "../proj/train.py"],
        cwd=cwd,
        env=_embedded_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    # The tool's own subprocesses start without the launcher's PYTHONSAFEPATH.
    assert "result [42, None]" in out.stdout, out.stdout + out.stderr


def _run_script(path: Path) -> subprocess.CompletedProcess[str]:
    run = [sys.executable, path.name]
    return subprocess.run(
        run, cwd=path.parent, env=_embedded_env(), capture_output=True, text=True, timeout=120
    )


def test_a_script_that_makes_a_client_when_imported_is_told_to_guard_it(tmp_path: Path) -> None:
    # The README's tool and its client in one file, unguarded: the orchestrator importing the script
    # for its tools started a second embedded orchestrator, and the error named a module nobody wrote.
    (tmp_path / "train.py").write_text(
        "from pydantic import BaseModel\n"
        "import tangram_env\n\n"
        "class N(BaseModel):\n"
        "    n: int\n\n"
        "@tangram_env.tool(name='script.double', cpu=0.1, mem_mb=16, timeout_s=10)\n"
        "def double(args: N) -> int:\n"
        "    return args.n * 2\n\n"
        "print('result', tangram_env.Client().call('script.double', {'n': 21}))\n"
    )
    run = _run_script(tmp_path / "train.py")
    said = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and "tangram_plugin_" not in said, run.stderr
    assert f"{tmp_path / 'train.py'} makes a client (or an env) when imported" in said, said
    assert 'put that code under `if __name__ == "__main__":`' in said
    guarded = (tmp_path / "train.py").read_text().replace("print(", 'if __name__ == "__main__":\n    print(')
    (tmp_path / "train.py").write_text(guarded)
    run = _run_script(tmp_path / "train.py")
    assert "result 42" in run.stdout, run.stdout + run.stderr


def test_a_kind_registered_after_the_embedded_orchestrator_started_is_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "late_tools.py").write_text(
        "from pydantic import BaseModel\n"
        "import tangram_env\n\n"
        "class N(BaseModel):\n"
        "    n: int\n\n"
        "@tangram_env.tool(name='late.add1', cpu=0.1, mem_mb=16, timeout_s=10)\n"
        "def add1(args: N) -> int:\n"
        "    return args.n + 1\n"
    )
    (tmp_path / "main.py").write_text(
        "import tangram_env\n"
        "with tangram_env.Client() as c:\n"
        "    import late_tools\n"
        "    print('message', c.run('late.add1', {'n': 1}).message)\n"
    )
    out = subprocess.run(
        [sys.executable, "main.py"],
        cwd=tmp_path,
        env=_embedded_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "no tool or reward model named 'late.add1'" in out.stdout, out.stdout + out.stderr
    assert "registered in this process (by late_tools) after its embedded orchestrator started" in out.stdout
    assert "import late_tools before the first Client or make()" in out.stdout


FORKED = """
import asyncio, os, sys
import tangram_env
from tangram_env.errors import ForkedClientError

client = tangram_env.Client()  # the embedded orchestrator
twin = tangram_env.AsyncClient.wrap(client)
assert client.call("echo", {"value": 1}) == 1
env = tangram_env.make("code", client=client)
env.reset(seed=0)
sock = client.address[len("ipc://"):]
pid = os.fork()
if pid == 0:
    env.close()  # gymnasium's close never raises; the episode's session stays the parent's
    print("child env close: ok", flush=True)
    try:
        client.call("echo", {"value": 2})
    except ForkedClientError as exc:
        print("child sync:", exc, flush=True)
    try:
        asyncio.run(twin.call("echo", {"value": 3}))
    except ForkedClientError:
        print("child async: refused", flush=True)
    client.close()  # the parent's connection and orchestrator are not this process's to end
    with tangram_env.Client(client.address) as own:  # what the error says to do
        print("child own client:", own.call("echo", {"value": 4}), flush=True)
    sys.exit(0)  # atexit runs in the child too
os.waitpid(pid, 0)
print("parent socket:", os.path.exists(sock))
print("parent env session:", env.session_id is not None)
env.close()
print("parent client:", client.call("echo", {"value": 5}))
with tangram_env.Client(client.address) as again:
    print("parent new client:", again.call("echo", {"value": 6}))
client.close()
"""


def test_a_forked_child_is_told_to_make_its_own_client_and_leaves_the_parents_orchestrator(
    tmp_path: Path,
) -> None:
    # A client used after os.fork() hung forever (its IO thread stayed in the parent), and a child's
    # close() or exit stopped the parent's embedded orchestrator and removed its socket.
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    out = _run_script(script)
    said = out.stdout
    assert out.returncode == 0, said + out.stderr
    assert "child sync: this Client was made in process" in said, said + out.stderr
    assert "Make a new Client (or env) in this process" in said
    assert "child async: refused" in said
    assert "child own client: 4" in said
    assert "child env close: ok" in said and "parent env session: True" in said
    assert "parent socket: True" in said
    assert "parent client: 5" in said
    assert "parent new client: 6" in said


EMBEDDED_KILLED = """
import asyncio, os, signal, threading, time
import tangram_env
from tangram_env.errors import ServerUnavailable

client = tangram_env.Client()
pid = client._embedded.process.pid
threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
t0 = time.monotonic()
try:
    client.call("sleep", {"seconds": 20})
except ServerUnavailable as exc:
    print(f"waiting call: {time.monotonic() - t0:.1f}s {exc}", flush=True)
t0 = time.monotonic()
try:
    client.call("echo", {"value": 1})
except ServerUnavailable as exc:
    print(f"next call: {time.monotonic() - t0:.2f}s", flush=True)
try:
    asyncio.run(tangram_env.AsyncClient.wrap(client).call("echo", {"value": 1}))
except ServerUnavailable:
    print("async call: refused", flush=True)
with tangram_env.Client() as again:
    print("new client:", again.call("echo", {"value": 2}), again._embedded.process.pid != pid, flush=True)
client.close()
"""


def test_a_dead_embedded_orchestrator_is_said_at_once_not_after_the_silence_timeout(tmp_path: Path) -> None:
    # Every call waited server_timeout_s (30 s) and then said the orchestrator "was silent", not that
    # the child had exited, nor that this client could never reach one again.
    script = tmp_path / "killed.py"
    script.write_text(EMBEDDED_KILLED)
    out = _run_script(script)
    said = out.stdout
    assert out.returncode == 0, said + out.stderr
    waited = float(said.split("waiting call: ", 1)[1].split("s ", 1)[0])
    assert waited < 5.0, said
    assert "the embedded orchestrator (process" in said and "exited killed by SIGKILL" in said, said
    assert "make a new env or Client" in said
    assert float(said.split("next call: ", 1)[1].split("s", 1)[0]) < 0.5, said
    assert "async call: refused" in said and "new client: 2 True" in said, said


def test_a_process_that_exits_without_closing_ends_its_sandbox_sessions_at_once(tmp_path: Path) -> None:
    # Its sandboxes stayed live for client_timeout_s (60 s) on a shared orchestrator: nothing sent their
    # end at exit, and the client's IO thread, a daemon, died with the interpreter.
    from tests.conftest import ServerProcess, wait_for

    srv = ServerProcess("--sandbox", "none")
    script = tmp_path / "leaves.py"
    script.write_text(
        "import sys, tangram_env\n"
        "client = tangram_env.Client(sys.argv[1])\n"
        "box = client.sandbox()\n"
        "print(box.bash('echo hi').stdout.strip(), flush=True)\n"  # no close, no with: the process ends
    )
    try:
        with tangram_env.Client(srv.address) as observer:
            out = subprocess.run(
                [sys.executable, str(script), srv.address], capture_output=True, text=True, timeout=60
            )
            assert out.stdout == "hi\n", out.stdout + out.stderr
            live = lambda: observer.stats()["sandbox_memory"]["live_sessions"]  # noqa: E731
            wait_for(lambda: live() == 0, 5.0, "the session to end")
    finally:
        srv.stop()
