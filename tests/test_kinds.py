from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

import tangram_env
from tangram_env.errors import AlreadyRegisteredError, UnknownNameError
from tangram_env.kinds import KindRegistry, reward_model, tool


class Add(BaseModel):
    """Two numbers."""

    a: int = Field(description="first")
    b: int = 0


def test_tool_registration_and_function_calling_schema() -> None:
    reg = KindRegistry()

    @tool(name="add", cpu=0.5, mem_mb=64, timeout_s=5, registry=reg)
    def add(args: Add) -> int:
        """Add two numbers."""
        return args.a + args.b

    spec = reg.get("add")
    assert spec.demand.cpu == 0.5 and spec.demand.mem_mb == 64 and spec.timeout_s == 5
    assert spec.validate_payload({"a": 1, "b": 2}) == Add(a=1, b=2)
    schema = spec.json_schema()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two numbers."
    assert fn["parameters"]["required"] == ["a"]
    assert fn["parameters"]["properties"]["a"]["description"] == "first"
    assert add(Add(a=2, b=3)) == 5  # the decorator returns the function itself


def test_unknown_kind_suggests_close_names() -> None:
    reg = KindRegistry()

    @tool(name="bash", registry=reg)
    def bash(args: Add) -> None:
        return None

    with pytest.raises(UnknownNameError, match="did you mean 'bash'"):
        reg.get("bsh")


def test_conflicting_registration_is_an_error() -> None:
    reg = KindRegistry()

    @tool(name="x", registry=reg)
    def one(args: Add) -> None:
        return None

    with pytest.raises(AlreadyRegisteredError):

        @tool(name="x", registry=reg)
        def two(args: Add) -> None:
            return None


def test_tool_needs_a_pydantic_argument_model() -> None:
    with pytest.raises(TypeError, match="pydantic model"):

        @tool(name="bad", registry=KindRegistry())
        def bad(args: int) -> None:
            return None


def test_reward_model_is_listed_with_its_demand() -> None:
    reg = KindRegistry()

    @reward_model(name="length", gpu=0.5, gpu_mem_mb=100, max_batch=8, registry=reg)
    def length(items: list[str]) -> list[float]:
        """Longer is better."""
        return [float(len(i)) for i in items]

    spec = reg.get("length")
    described = spec.describe()
    assert described["role"] == "reward_model"
    assert described["demand"]["gpu"] == 0.5 and described["options"]["max_batch"] == 8
    assert spec.validate_payload({"items": ["a"]}).items == ["a"]  # type: ignore[union-attr]


def test_global_listing_contains_registered_tools() -> None:
    import tests.plugins  # noqa: F401

    names = {t["name"] for t in tangram_env.tools()}
    assert {"test.touch", "test.raise"} <= names
    assert all(t["schema"]["type"] == "function" for t in tangram_env.tools(role="tool"))
