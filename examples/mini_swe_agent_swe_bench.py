"""mini-swe-agent's own agent solving an offline SWE-bench instance in a Tangram sandbox, graded by Tangram.

    pip install "tangram-env[mini-swe-agent]"
    python examples/mini_swe_agent_swe_bench.py [--instance-id ID]

The model here is mini-swe-agent's ``DeterministicModel`` replaying a script (look around, apply the
instance's gold patch, submit); swap in ``LitellmModel`` for a real one. Every command the agent runs
is an action in the session's sandbox; the submission is graded in a fresh sandbox by the instance's
tests.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from minisweagent.agents.default import DefaultAgent
from minisweagent.models.test_models import DeterministicModel, make_output

import tangram_env
from tangram_env.adapters.mini_swe_agent import SUBMIT_MARKER, TangramEnvironment
from tangram_env.envs.swe_bench.prepare import offline_instances

SYSTEM = "You are a helpful assistant that can interact with a computer shell."
INSTANCE = "Please solve this issue:\n\n{{task}}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--instance-id", default=None)
    p.add_argument("--address", default=None)
    args = p.parse_args()
    instances = offline_instances()
    inst = next((i for i in instances if i.instance_id == args.instance_id), instances[0])
    script = DeterministicModel(
        outputs=[
            make_output("Let me look at the repository.", [{"command": "git log --oneline -1 && ls"}]),
            make_output(
                "I will apply my fix.",
                [{"command": f"git apply <<'TANGRAM_PATCH_END'\n{inst.patch}TANGRAM_PATCH_END\n"}],
            ),
            make_output(
                "Submitting.", [{"command": f"echo {SUBMIT_MARKER} && git add -A && git diff --cached"}]
            ),
        ]
    )
    with tangram_env.Client(args.address) as client:
        env = TangramEnvironment.for_swe_bench(inst, client=client, timeout=120)
        try:
            agent = DefaultAgent(
                script, env, system_template=SYSTEM, instance_template=INSTANCE, step_limit=10
            )
            result = agent.run(inst.problem_statement)
            print(
                f"{inst.instance_id}: agent exit status {result['exit_status']}, {agent.n_calls} model calls"
            )
            grade = env.grade(result.get("submission"))
        finally:
            env.close()
    print(f"resolved: {grade['resolved']} (reward {1.0 if grade['resolved'] else 0.0})")


if __name__ == "__main__":
    main()
