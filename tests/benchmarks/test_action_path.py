"""The action-path benchmark's gymnasium peer grades as the ``code`` env does: right answers only."""

from __future__ import annotations

import gymnasium

from benchmarks.action_path import PlainHarnessEnv
from tangram_env.envs.code_tasks import get_task


def test_the_plain_peer_rewards_right_answers_and_only_those() -> None:
    envs = gymnasium.vector.AsyncVectorEnv([PlainHarnessEnv, PlainHarnessEnv])
    try:
        _, infos = envs.reset(seed=3)
        tasks = [get_task(str(t)) for t in infos["task_id"]]
        _, rewards, terminated, _, _ = envs.step([t.reference_solution for t in tasks])
        assert rewards.tolist() == [1.0, 1.0] and terminated.all()
        envs.reset(seed=3)
        _, rewards, terminated, _, _ = envs.step(["def nothing():\n    pass\n"] * 2)
        assert (rewards < 1.0).all() and not terminated.any()
    finally:
        envs.close()
