"""benchmarks.async_rollouts runs both modes on the real orchestrator and reports what the issue names."""

from __future__ import annotations

from benchmarks import async_rollouts


def test_a_small_run_reports_both_modes_and_the_speedup(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["--json", "--scales", "6", "--steps", "1", "--think-ms", "0,20", "--echo-steps", "3"]
    figures = async_rollouts.main(argv)
    run, echo = figures["scales"]["6"], figures["echo"]["scales"]["6"]
    for mode in ("threads", "asyncio"):
        assert run[mode]["actions"] == 6 * 2 and run[mode]["actions_per_s"] > 0  # two rounds each
        assert run[mode]["client_cpu_ms_per_action"] > 0
        assert echo[mode]["actions"] == 18 * 2
    assert figures["speedup_at_6"] == run["speedup"] > 0 and figures["echo"]["speedup_at_6"] > 0
    assert '"speedup_at_6"' in capsys.readouterr().out
