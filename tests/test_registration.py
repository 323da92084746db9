from __future__ import annotations

import gymnasium
import pytest

import tangram_env
from tangram_env.errors import UnknownNameError


class Tiny(gymnasium.Env[int, int]):
    def __init__(self, size: int = 3, max_episode_steps: int | None = None) -> None:
        self.size = size
        self.observation_space = gymnasium.spaces.Discrete(size)
        self.action_space = gymnasium.spaces.Discrete(size)


def test_register_spec_make_mirror_gymnasium() -> None:
    tangram_env.register("tiny-test", Tiny, size=4)
    spec = tangram_env.spec("tiny-test")
    assert spec.kwargs == {"size": 4} and tangram_env.spec("tangram/tiny-test") is spec
    env = tangram_env.make("tiny-test", size=5)
    assert env.size == 5 and env.spec.id == "tangram/tiny-test"
    assert "tiny-test" in tangram_env.registry
    # The same env through gymnasium's own make, under the tangram namespace.
    assert gymnasium.make("tangram/tiny-test").unwrapped.size == 4


def test_unknown_env_has_a_hint() -> None:
    with pytest.raises(UnknownNameError, match="did you mean 'code'"):
        tangram_env.spec("cdoe")


def test_builtin_envs_are_registered() -> None:
    assert {"code", "swe-bench"} <= set(tangram_env.registry)


@pytest.mark.parametrize("count", [0, -1, 1.5, True])
def test_make_vec_refuses_a_bad_count_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, count: object
) -> None:
    from tangram_env import embedded

    monkeypatch.delenv("TANGRAM_ADDRESS", raising=False)
    before = embedded._current, embedded._current.users if embedded._current else 0
    with pytest.raises(ValueError, match=r"num_envs must be a whole number >= 1"):
        tangram_env.make_vec("code", count)  # type: ignore[arg-type]
    # No client was made for it, so no embedded orchestrator was started (or kept) for it.
    assert (embedded._current, embedded._current.users if embedded._current else 0) == before


def test_every_tangram_spec_serialises_and_round_trips_through_json() -> None:
    # The vector entry point was a functools.partial, which EnvSpec.to_json refuses for every id.
    for id in ("code", "swe-bench", "deep-search"):
        spec = gymnasium.spec(f"tangram/{id}")
        again = gymnasium.envs.registration.EnvSpec.from_json(spec.to_json())
        assert again.vector_entry_point == f"tangram_env.vector_entry:{id}"
    creator = gymnasium.envs.registration.load_env_creator(gymnasium.spec("tangram/code").vector_entry_point)
    with pytest.raises(ValueError, match="num_envs must be a whole number"):
        creator(num_envs=0)  # the make_vec of that id, checking its arguments before it starts anything
    for bad in ("a:b", "__x", ""):
        with pytest.raises(ValueError, match="an id is not empty, has no ':'"):
            tangram_env.register(bad, Tiny)
    # A namespace of its own failed in gymnasium, naming "tangram/myteam/my-env-v0".
    with pytest.raises(
        ValueError, match="has one namespace: give an id without '/', such as 'myteam-my-env-v0'"
    ):
        tangram_env.register("myteam/my-env-v0", Tiny)
