"""``SweBenchEnv``: resolve a GitHub-style issue in a repository, graded by the repository's tests.

Observation: the problem statement first, then the text of each tool's result. Action: one tool call
as text (see :mod:`tangram_env.envs.swe_bench.calls` for the accepted formats and the raw-text
fallback); the tools are ``bash``, ``view``, ``str_replace``, ``create`` and ``submit``. An invalid call
is an observation saying what was wrong. Tool calls run as actions in the episode's sandbox (one
sandbox per episode, by affinity). ``submit``, or reaching ``max_turns``, ends the episode: the working
tree's diff is graded in a fresh sandbox (an elastic action whose test shards spread over the cores
it is granted). Reward 1.0 when the instance is resolved, else 0.0; ``info["report"]`` holds
SWE-bench's per-test report, ``info["reward_reason"]`` why a reward was 0.0, ``info["dropped_edits"]``
the changes to test machinery that were not graded and ``info["tampering"]`` why a test run was
void (see :mod:`tangram_env.envs.swe_bench.grading`). When the diff or the grading action fails, the
step has no reward (:class:`~tangram_env.errors.RewardUnavailable`, or a flagged step with
``invalid_reward="flag"``), never a 0.0.
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path
from typing import Any

import gymnasium
from pydantic import BaseModel

from tangram_env.chat import ChatTextEnv, check_tools
from tangram_env.env import AnyText, EnvGen, TangramEnv, check_turns
from tangram_env.envs.swe_bench.calls import CallError, ToolCall, parse_call
from tangram_env.envs.swe_bench.instance import (
    InstanceError,
    SweBenchInstance,
    load_instances,
    validate_instance,
)
from tangram_env.envs.swe_bench.tools import MAX_GRADE_PAR
from tangram_env.errors import UnknownNameError, did_you_mean
from tangram_env.protocol import Action, Elastic, Result
from tangram_env.rewards import graded
from tangram_env.shell_tools import ARGS_MODELS, OUTPUT_CAP

MAX_TEXT = 2_000_000
TOOL_NAMES = ("bash", "view", "str_replace", "create", "submit")
_TESTS_PER_SHARD = 25


class SubmitArgs(BaseModel):
    """Submit the working tree's changes for grading; ends the episode."""


def tool_schemas() -> list[dict[str, Any]]:
    """The env's tools in the function-calling JSON format (what to show an LLM)."""
    from tangram_env.kinds import kind_registry

    out = [kind_registry.get(name).json_schema() for name in TOOL_NAMES if name != "submit"]
    out.append(
        {
            "type": "function",
            "function": {
                "name": "submit",
                "description": SubmitArgs.__doc__,
                "parameters": {"type": "object", "properties": {}},
            },
        }
    )
    return out


def _resolve_instances(
    instances: Any,
    split: str,
    cache_dir: str | None,
    auto_prepare: bool,
    instance_format: str = "auto",
    skip_bad_rows: bool = False,
) -> list[SweBenchInstance]:
    if instances is None:
        from tangram_env.envs.swe_bench.prepare import offline_instances

        return offline_instances(cache_dir, auto_prepare=auto_prepare)
    if isinstance(instances, (str, Path)) and (skip_bad_rows or instance_format != "auto"):
        from tangram_env.envs.swe_bench.formats import load_file  # SWE-Gym, SWE-smith, R2E-Gym files

        return load_file(instances, instance_format, skip_bad=skip_bad_rows).instances
    if isinstance(instances, (str, Path)):
        return load_instances(instances, split=split)
    out = [validate_instance(i.model_dump() if isinstance(i, SweBenchInstance) else i) for i in instances]
    if not out:
        raise InstanceError("instances is empty")
    return out


class SweBenchEnv(ChatTextEnv, TangramEnv[str, str]):
    """SWE-bench as a gymnasium env; see the module docstring.

    ``instances``: None for the offline set (prepared on first use), a JSON/JSONL/parquet path, a data
    set name (``swe-bench-lite``, ``princeton-nlp/SWE-bench_Verified``, ...) or a list of instances.
    ``instance_format`` (``auto``, ``swe-bench``, ``swe-gym``, ``swe-smith``, ``r2e-gym``) and
    ``skip_bad_rows`` (leave out, and log, rows that do not validate) apply to an instance file.
    ``max_turns``: tool calls before the episode is graded and truncated. ``instance_ids``: restrict
    the set. ``command_timeout_s``: default limit of a ``bash`` call; ``grade_timeout_s``: of grading.
    ``chat``: observations as chat messages and actions as OpenAI tool calls (see :mod:`tangram_env.chat`);
    ``env.tools`` is the OpenAI ``tools`` list either way.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"]}
    reset_options = frozenset({"instance_id"})

    def __init__(
        self,
        *,
        instances: Any = None,
        max_turns: int = 50,
        split: str = "test",
        instance_ids: list[str] | None = None,
        cache_dir: str | None = None,
        auto_prepare: bool = True,
        command_timeout_s: float = 120.0,
        grade_timeout_s: float = 900.0,
        instance_format: str = "auto",
        skip_bad_rows: bool = False,
        chat: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.max_turns = check_turns(max_turns)  # before the instances, which may take minutes to prepare
        import tangram_env.envs.swe_bench.tools
        import tangram_env.shell_tools  # noqa: F401 - registers bash/view/str_replace/create here too

        self.instances = _resolve_instances(
            instances, split, cache_dir, auto_prepare, instance_format, skip_bad_rows
        )
        self._by_id = {i.instance_id: i for i in self.instances}
        if instance_ids:
            self.instances = [self.get_instance(i) for i in instance_ids]
        self.command_timeout_s = command_timeout_s
        self.grade_timeout_s = grade_timeout_s
        self.observation_space = AnyText(max_length=MAX_TEXT, min_length=0, charset=string.printable)
        self.action_space = AnyText(max_length=MAX_TEXT, min_length=0, charset=string.printable)
        self.tools = check_tools(tool_schemas())
        self._use_chat(chat)
        self._arg_models: dict[str, type[BaseModel] | None] = {**ARGS_MODELS, "submit": None}
        self.instance = self.instances[0]
        self.turn = 0
        self._done = False
        self._observation = ""

    def get_instance(self, instance_id: str) -> SweBenchInstance:
        """The instance with that id, or :class:`UnknownNameError` with the closest ids."""
        try:
            return self._by_id[instance_id]
        except KeyError:
            extra = did_you_mean(instance_id, self._by_id)
            raise UnknownNameError(f"no instance {instance_id!r} in this set{extra}") from None

    # --- episode ----------------------------------------------------------------------------------
    def _intro(self) -> str:
        inst = self.instance
        return (
            f"<issue repo={inst.repo!r} instance={inst.instance_id!r}>\n"
            f"{inst.problem_statement.strip()}\n</issue>\n\n"
            f"The repository is checked out in your working directory at commit {inst.base_commit[:12]}. "
            "Change the source so that the issue is resolved; the project's tests will check it. "
            + (
                "Call one tool per turn. "
                if self.chat
                else 'Use one tool per turn, as a JSON call such as {"name": "bash", "arguments": '
                '{"command": "git status"}}. '
            )
            + "Tools: "
            + ", ".join(TOOL_NAMES)
            + f". Call submit when you are done (you have {self.max_turns} turns)."
        )

    def _reset(
        self, *, seed: int | None, options: dict[str, Any] | None
    ) -> EnvGen[tuple[str, dict[str, Any]]]:
        chosen = (options or {}).get("instance_id")
        if chosen is not None:
            self.instance = self.get_instance(str(chosen))
        else:
            self.instance = self.instances[int(self.np_random.integers(len(self.instances)))]
        self.turn = 0
        self._done = False
        self._observation = self._intro()
        info = {
            "instance_id": self.instance.instance_id,
            "repo": self.instance.repo,
            "max_turns": self.max_turns,
            "tools": self.tools,
        }
        return self._observation, info
        yield []  # a reset runs no action: the session's sandbox starts warm on its first call

    def _step(self, action: str) -> EnvGen[tuple[str, float, bool, bool, dict[str, Any]]]:
        if self._done:
            raise gymnasium.error.ResetNeeded("the episode is over; call reset()")
        self.turn += 1
        call = parse_call(action, self._arg_models)
        info: dict[str, Any] = {"instance_id": self.instance.instance_id, "turn": self.turn}
        if isinstance(call, ToolCall) and call.name == "submit":
            return (yield from self._finish(info, truncated=False))
        if isinstance(call, CallError):
            info["call_error"] = call.message
            text = f"Error: {call.message}"
        else:
            info["tool"] = call.name
            (result,) = yield [self._tool_action(call)]
            if result.error_type == "sandbox_died":  # the episode's files are gone: no verdict can come
                graded(result, f"the {call.name} call")
            text = render_result(call.name, result)
        if self.turn >= self.max_turns:
            finished = yield from self._finish(info, truncated=True)
            text = f"{text}\n\nOut of turns: the working tree was submitted for grading."
            self._observation = text
            return text, finished[1], finished[2], finished[3], finished[4]
        self._observation = text
        return text, 0.0, False, False, info

    def _tool_action(self, call: ToolCall) -> Action:
        args = dict(call.arguments)
        if call.name == "bash" and "timeout_s" not in args:
            args["timeout_s"] = self.command_timeout_s
        return Action(
            kind=call.name, payload=args, affinity=self.session_id, image=self.instance.sandbox_image
        )

    def _finish(
        self, info: dict[str, Any], *, truncated: bool
    ) -> EnvGen[tuple[str, float, bool, bool, dict[str, Any]]]:
        """Diff the working tree in the episode's sandbox, then grade it in a fresh one. A submit ends
        the episode as terminated; running out of turns as truncated (graded all the same).
        """
        self._done = True
        inst = self.instance
        (diffed,) = yield [
            Action(
                kind="swe_bench.diff",
                # Against the base commit: a fix the agent committed is still its fix.
                payload={"workdir": inst.workdir, "base": inst.base_commit},
                affinity=self.session_id,
                image=inst.sandbox_image,
            )
        ]
        diff = graded(diffed, "reading the working tree's diff")  # its failure is no verdict either
        patch: str | None = diff.get("patch")
        if patch is None:
            info["diff_error"] = diff.get("error")  # the agent's sandbox has no diff to give
        (result,) = yield [grade_action(inst, patch, self.grade_timeout_s)]
        value = graded(result, "grading")  # RewardUnavailable if grading itself failed
        resolved = bool(value["resolved"])
        info.update(
            patch=patch,
            report=value["report"],
            resolved=resolved,
            statuses=value.get("statuses", {}),
            dropped_edits=value.get("dropped_edits", []),
            tampering=value.get("tampering"),
            reward_reason=value.get("reason"),
            grade_parallelism=result.parallelism,
            grade_wall_s=value.get("wall_s"),
        )
        status = value["report"][inst.instance_id]["tests_status"]
        text = (
            f"Submitted. Resolved: {'yes' if resolved else 'no'} "
            f"(FAIL_TO_PASS {len(status['FAIL_TO_PASS']['success'])}/{len(inst.FAIL_TO_PASS)} passing, "
            f"PASS_TO_PASS {len(status['PASS_TO_PASS']['success'])}/{len(inst.PASS_TO_PASS)} passing)."
        )
        if value.get("dropped_edits"):
            names = ", ".join(d["path"] for d in value["dropped_edits"][:5])
            text += f" Not graded (changes to test machinery are dropped): {names}."
        if value.get("tampering"):
            text += f" The test run was void: {value['tampering']}."
        self._observation = text
        return text, 1.0 if resolved else 0.0, not truncated, truncated, info

    def render(self) -> str | None:
        """The latest observation (``render_mode="ansi"``)."""
        return self._observation if self.render_mode == "ansi" else None


def grade_action(inst: SweBenchInstance, patch: str | None, timeout_s: float = 900.0) -> Action:
    """The action that grades ``patch`` on ``inst`` in a fresh sandbox of its image (its value is
    SWE-bench's report; see :mod:`tangram_env.envs.swe_bench.tools`), sharded over up to one core per
    25 tests.
    """
    tests = len(inst.FAIL_TO_PASS) + len(inst.PASS_TO_PASS)
    par = max(1, min(MAX_GRADE_PAR, math.ceil(tests / _TESTS_PER_SHARD)))
    return Action(
        kind="swe_bench.grade",
        image=inst.sandbox_image,
        elastic=Elastic(min_par=1, max_par=par),
        payload={"instance": inst.model_dump(), "patch": patch, "timeout_s": timeout_s},
        timeout_s=timeout_s + 120,
    )


def render_result(tool: str, result: Result) -> str:
    """A tool's result as the text the agent reads."""
    if not result.ok:
        return f"Error: the {tool} call failed ({result.error_type}): {result.message}"
    value = result.value if isinstance(result.value, dict) else {"output": result.value}
    if value.get("error"):
        return f"Error: {value['error']}"
    if tool == "bash":
        parts = [f"exit code: {value.get('exit_code')}"]
        if value.get("killed_by"):
            parts.append(f"(stopped: {value['killed_by']})")
        text = " ".join(parts)
        if value.get("stdout"):
            text += f"\nstdout:\n{value['stdout']}"
        if value.get("stderr"):
            text += f"\nstderr:\n{value['stderr']}"
        return text[: OUTPUT_CAP * 2 + 200]
    output = value.get("output")
    return str(output) if output is not None else json.dumps(value)[:OUTPUT_CAP]
