"""Quickstart: the ``code`` env with a scripted agent, on the embedded orchestrator.

    python examples/quickstart.py

The agent answers the task right once and wrong once; each answer's unit tests run as an action in a
sandbox, and the script prints the reward and the ACT (action completion time) of every action.
"""

from __future__ import annotations

import tangram_env

RIGHT = """
def run_length_encode(text: str) -> str:
    out = []
    i = 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{j - i}{text[i]}")
        i = j
    return "".join(out)
"""

WRONG = """
def run_length_encode(text: str) -> str:
    return "".join(f"1{c}" for c in text)   # forgets to count repeats
"""


def main() -> None:
    env = tangram_env.make("code", max_turns=2)
    try:
        for name, answer in (("right", RIGHT), ("wrong", WRONG)):
            env.reset(options={"task_id": "run-length-encode"})
            try:
                _obs, reward, _terminated, _truncated, info = env.step(answer)
            except tangram_env.RewardUnavailable as exc:  # the grading failed (e.g. no sandbox): no reward
                print(f"{name} answer could not be graded: {exc}")
                continue
            print(f"{name} answer: reward {reward:.2f} ({info['passed']}/{info['total']} tests passed)")
            for action in info["actions"]:
                print(
                    f"  action {action['id'][:8]}: ACT {action['act_s'] * 1000:.1f} ms "
                    f"(queued {action['queued_s'] * 1000:.1f}, set-up {action['setup_s'] * 1000:.1f}, "
                    f"run {action['run_s'] * 1000:.1f})"
                )
    finally:
        env.close()


if __name__ == "__main__":
    main()
