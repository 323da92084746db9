"""``gymnasium.make_vec("tangram/code", n)``: gymnasium's own entry point returns Tangram's vector env.

    python examples/gymnasium_make_vec.py

The vector env shares one connection, submits every env's actions of a step together, and offers
gymnasium's ``call``/``get_attr``/``set_attr``; its ``astep`` and ``astep_as_completed`` are there for
asyncio code.
"""

from __future__ import annotations

import gymnasium

import tangram_env

SOURCE = "def run_length_encode(text: str) -> str:\n    return ''.join(f'1{c}' for c in text)\n"


def main() -> None:
    vec = gymnasium.make_vec("tangram/code", num_envs=4, max_turns=1)
    try:
        assert isinstance(vec, tangram_env.TangramVectorEnv)
        vec.reset(seed=0, options={"task_id": "run-length-encode"})
        print("tasks:", vec.get_attr("task")[0].id)
        _obs, rewards, terminations, _truncations, _infos = vec.step([SOURCE] * 4)
        print("rewards:", rewards.tolist(), "terminated:", terminations.tolist())
        vec.set_attr("per_test_timeout_s", 5.0)
        print("per-test time limits:", vec.get_attr("per_test_timeout_s"))
    finally:
        vec.close()


if __name__ == "__main__":
    main()
