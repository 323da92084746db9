from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

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


# --- what registration refuses: arguments no action of the kind could ever run with ---------------
_BAD_TOOL_ARGUMENTS = [
    ({"timeout_s": 0}, "timeout_s=0 is invalid"),
    ({"timeout_s": -1}, "timeout_s=-1 is invalid"),
    ({"timeout_s": float("inf")}, "timeout_s=inf is invalid"),
    ({"timeout_s": float("nan")}, "timeout_s=nan is invalid"),
    ({"cpu": -1}, "cpu=-1 is invalid"),
    ({"cpu": float("nan")}, "cpu=nan is invalid"),
    ({"cpu": 1e7}, "cpu=10000000.0 is invalid"),
    ({"mem_mb": -5}, "mem_mb=-5 is invalid"),
    ({"gpu": float("inf")}, "gpu=inf is invalid"),
    ({"gpu_mem_mb": -1}, "gpu_mem_mb=-1 is invalid"),
    ({"min_par": 0}, "min_par=0 is invalid"),
    ({"min_par": 3, "max_par": 2}, "max_par=2 is below min_par=3"),
    ({"placement": "bogus"}, "placement='bogus' is invalid"),
    ({"name": ""}, "name '' is invalid"),
    ({"name": "a" * 129}, "129 characters long"),
]


@pytest.mark.parametrize(("kwargs", "why"), _BAD_TOOL_ARGUMENTS)
def test_a_tool_registered_with_arguments_no_action_could_run_with_is_refused(
    kwargs: dict[str, object], why: str
) -> None:
    reg = KindRegistry()
    with pytest.raises(ValueError, match=why) as refused:
        tool(**{"name": "t", **kwargs}, registry=reg)(_add)  # type: ignore[arg-type]
    assert len(reg) == 0
    if "name" not in kwargs:
        assert "tool 't'" in str(refused.value) and "pass " in str(refused.value)  # names the fix


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"timeout_s": 0}, "reward_model 'rm': timeout_s=0 is invalid"),
        ({"gpu": -1}, "gpu=-1 is invalid"),
        ({"max_batch": 0}, "max_batch=0 is invalid"),
        ({"max_wait_ms": float("nan")}, "max_wait_ms=nan is invalid"),
        ({"max_par": 0}, "max_par=0 is invalid"),
    ],
)
def test_a_reward_model_registered_with_bad_numbers_is_refused(kwargs: dict[str, object], why: str) -> None:
    reg = KindRegistry()
    with pytest.raises(ValueError, match=why):
        reward_model(name="rm", registry=reg, **kwargs)(lambda items: [0.0] * len(items))  # type: ignore[arg-type]
    assert len(reg) == 0


def _add(args: Add) -> int:
    return args.a + args.b


def test_the_largest_name_and_the_bounds_themselves_are_accepted() -> None:
    reg = KindRegistry()
    tool(name="a" * 128, cpu=0, mem_mb=0, timeout_s=1e-3, min_par=2, max_par=2, registry=reg)(_add)
    assert reg.get("a" * 128).elastic.min_par == 2


def test_a_tool_with_a_second_required_parameter_is_refused() -> None:
    def two(args: Add, scale: int) -> int:
        return args.a * scale

    with pytest.raises(TypeError, match="second required parameter 'scale'"):
        tool(name="two", registry=KindRegistry())(two)

    def optional(args: Add, scale: int = 2, *, ctx: object = None) -> int:  # defaults and ctx are fine
        return args.a * scale

    reg = KindRegistry()
    tool(name="optional", registry=reg)(optional)
    assert reg.get("optional").takes_ctx


def test_a_reward_model_class_without_score_is_refused() -> None:
    class NoScore:
        def load(self, device: str) -> None:
            pass

    with pytest.raises(TypeError, match=r"class .*NoScore has no score method: define score"):
        reward_model(name="rm", registry=KindRegistry())(NoScore)

    class Scores(tangram_env.RewardModel):
        def score(self, batch: list[object]) -> list[float]:
            return [0.0] * len(batch)

    reg = KindRegistry()
    reward_model(name="rm", registry=reg)(Scores)
    assert reg.get("rm").options["is_class"]


@pytest.mark.parametrize("memory", ["1GB", float("nan"), float("inf"), -900, True])
def test_a_reward_model_class_with_an_unusable_memory_mb_is_refused(memory: object) -> None:
    # "1GB" made every worker serving it exit at registration; NaN timed its requests out; -900
    # over-committed the device.
    class Model(tangram_env.RewardModel):
        memory_mb = memory  # type: ignore[assignment]

        def score(self, batch: list[object]) -> list[float]:
            return [0.0] * len(batch)

    with pytest.raises(ValueError, match=r"Model: memory_mb=.* is invalid: give the MiB"):
        reward_model(name="rm", registry=KindRegistry())(Model)


def test_an_async_reward_model_is_refused() -> None:
    async def scores(items: list[str]) -> list[float]:
        return [0.0] * len(items)

    class AsyncModel(tangram_env.RewardModel):
        async def score(self, batch: list[object]) -> list[float]:  # type: ignore[override]
            return [0.0] * len(batch)

    for target in (scores, AsyncModel):
        with pytest.raises(TypeError, match="score is a coroutine function"):
            reward_model(name="rm", registry=KindRegistry())(target)


# --- unknown argument keys ------------------------------------------------------------------------
def test_a_misspelt_argument_key_is_refused_naming_it_and_the_accepted_ones() -> None:
    reg = KindRegistry()
    tool(name="add", registry=reg)(_add)
    with pytest.raises(ValueError, match=r"unknown key 'bb' \(did you mean 'b'\?\); it accepts 'a', 'b'"):
        reg.get("add").validate_payload({"a": 1, "bb": 2})
    assert reg.get("add").validate_payload({"a": 1}) == Add(a=1)


class Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")
    a: int = 0


class Aliased(BaseModel):
    a: int = Field(0, alias="A")


def test_a_model_that_chose_what_to_do_with_extra_keys_keeps_its_choice() -> None:
    def loose(args: Loose) -> int:
        return args.a

    def aliased(args: Aliased) -> int:
        return args.a

    reg = KindRegistry()
    tool(name="loose", registry=reg)(loose)
    tool(name="aliased", registry=reg)(aliased)
    assert reg.get("loose").validate_payload({"a": 1, "extra": 2}) == Loose(a=1)
    assert reg.get("aliased").validate_payload({"A": 3}) == Aliased(A=3)
    with pytest.raises(ValueError, match="unknown key 'b'"):
        reg.get("aliased").validate_payload({"b": 3})


def test_an_unknown_kind_names_the_plugins_that_failed_to_import() -> None:
    reg = KindRegistry()
    reg.failed_plugins["broken"] = "broken.tools: ModuleNotFoundError: No module named 'dep'"
    with pytest.raises(UnknownNameError, match=r"failed to import on this server.*broken \(broken.tools"):
        reg.get("broken.echo")
