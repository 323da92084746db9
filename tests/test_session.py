"""Sandbox sessions as a public API: each call an action with the session's affinity, in a real sandbox."""

from __future__ import annotations

import asyncio

import pytest

from tangram_env import AsyncClient, Client
from tangram_env.errors import ActionError, ClosedEnvError


def test_sync_session_keeps_files_between_calls_and_reports_commands(client: Client) -> None:
    with client.sandbox() as box:
        box.write_file("pkg/data.bin", bytes(range(256)))
        assert box.read_file("pkg/data.bin") == bytes(range(256))
        out = box.bash("ls pkg && wc -c < pkg/data.bin && echo oops >&2 && exit 3")
        assert out.exit_code == 3 and not out.ok
        assert out.stdout.split() == ["data.bin", "256"] and out.stderr.strip() == "oops"
        slow = box.bash("sleep 5", timeout_s=1)
        assert slow.killed_by == "timeout" and not slow.ok
        with pytest.raises(ActionError, match=r"missing\.txt"):
            box.read_file("missing.txt")
        assert box.bash("cat pkg/data.bin | wc -c").stdout.strip() == "256"  # still usable
    with pytest.raises(ClosedEnvError):
        box.bash("true")


def test_sessions_are_separate_sandboxes(client: Client) -> None:
    with client.sandbox() as a, client.sandbox() as b:
        a.write_file("who", "a")
        b.write_file("who", "b")
        assert (a.read_file("who"), b.read_file("who")) == (b"a", b"b")


def test_async_sessions_run_concurrently(server) -> None:  # type: ignore[no-untyped-def]
    async def agent(client: AsyncClient, n: int) -> str:
        async with client.sandbox(image="default") as box:
            await box.write_file("n.txt", str(n))
            out = await box.bash("python3 -c 'print(int(open(\"n.txt\").read()) ** 2)'", timeout_s=30)
            assert out.ok, out
            return out.stdout.strip()

    async def main() -> list[str]:
        async with AsyncClient(server.address) as client:
            return list(await asyncio.gather(*(agent(client, n) for n in range(6))))

    assert asyncio.run(main()) == [str(n * n) for n in range(6)]
