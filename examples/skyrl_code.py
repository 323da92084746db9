"""A Tangram env inside SkyRL-gym, the way SkyRL's generator drives its text envs.

    pip install "tangram-env[skyrl]"
    python examples/skyrl_code.py

``skyrl_gym.make("tangram", env_config=..., extras=...)`` gives a ``BaseTextEnv`` over the Tangram
env named in ``env_config``; SkyRL calls ``init`` with the data row's prompt and ``step`` with each
LLM response. A scripted "LLM" answers here: a wrong solution, then a right one. Each turn pays what
its submission's score gained on the last one, so the episode's return is the final score.
"""

from __future__ import annotations

import argparse

import skyrl_gym

from tangram_env.adapters.skyrl import register

RESPONSES = [
    "def run_length_encode(text: str) -> str:\n    return text\n",
    "def run_length_encode(text: str) -> str:\n"
    "    out, i = [], 0\n"
    "    while i < len(text):\n"
    "        j = i\n"
    "        while j < len(text) and text[j] == text[i]:\n"
    "            j += 1\n"
    "        out.append(f'{j - i}{text[i]}')\n"
    "        i = j\n"
    "    return ''.join(out)\n",
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", default=None)
    args = p.parse_args()
    register()
    env = skyrl_gym.make(
        "tangram",
        env_config={"env_id": "code", "address": args.address, "env_kwargs": {"max_turns": 2}},
        extras={"reset_options": {"task_id": "run-length-encode"}},
    )
    try:
        prompt, _ = env.init([{"role": "system", "content": "Answer with Python source only."}])
        print(f"prompt: {len(prompt)} messages; task: {prompt[-1]['content'].splitlines()[0]}")
        episode_return = 0.0
        for turn, response in enumerate(RESPONSES, 1):
            out = env.step(response)
            episode_return += out["reward"]
            print(f"turn {turn}: reward {out['reward']:.2f}, done {out['done']}")
            if out["done"]:
                break
        print(f"return {episode_return:.2f}")
    finally:
        env.close()


if __name__ == "__main__":
    main()
