"""A Tangram env as a verl tool, called the way verl's tool agent loop calls it.

    pip install "tangram-env[verl]"
    python examples/verl_code_tool.py

In training, verl builds the tool from its tool config (see docs/verl.md) and calls ``create``,
``execute`` and ``release`` for each tool call a model makes, on its agent loop worker's event loop.
Here a script plays the model: 16 trajectories at once, each submitting a solution through the
``submit_solution`` tool of the ``code`` env; the tool reward is the fraction of tests passed.
"""

from __future__ import annotations

import argparse
import asyncio

from verl.experimental.agent_loop.tool_agent_loop import AgentData

from tangram_env.adapters.verl import TangramEnvTool

RIGHT = (
    "def run_length_encode(text: str) -> str:\n"
    "    out, i = [], 0\n"
    "    while i < len(text):\n"
    "        j = i\n"
    "        while j < len(text) and text[j] == text[i]:\n"
    "            j += 1\n"
    "        out.append(f'{j - i}{text[i]}')\n"
    "        i = j\n"
    "    return ''.join(out)\n"
)
WRONG = "def run_length_encode(text: str) -> str:\n    return text\n"


async def trajectory(tool: TangramEnvTool, n: int) -> float:
    data = AgentData(
        messages=[], image_data=[], video_data=[], audio_data=None, mm_processor_kwargs=None,
        metrics={}, request_id=f"trajectory-{n}", tools_kwargs={},
    )  # fmt: skip
    create = {"create_kwargs": {"options": {"task_id": "run-length-encode"}}}
    instance_id, _ = await tool.create(**create)
    try:
        _response, reward, _metrics = await tool.execute(
            instance_id, {"source": RIGHT if n % 2 else WRONG}, agent_data=data
        )
    finally:
        await tool.release(instance_id)
    assert data.extra_fields["reward_valid"]
    return float(reward)


async def main(address: str | None) -> None:
    tool = TangramEnvTool(
        {"type": "native", "env_id": "code", "address": address, "env_kwargs": {"max_turns": 1}}, None
    )
    rewards = await asyncio.gather(*(trajectory(tool, n) for n in range(16)))
    print(f"tool {tool.name}: rewards {[round(r, 2) for r in rewards]}")
    print(f"right answers: {sum(r == 1.0 for r in rewards)}/16")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--address", default=None)
    asyncio.run(main(p.parse_args().address))
