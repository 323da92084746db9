from __future__ import annotations

import pickle

import pytest

from tangram_env.errors import ActionError, ActionTimeout, TangramError, UnknownNameError
from tangram_env.protocol import Result
from tangram_env.units import parse_duration, parse_size, parse_size_mb


@pytest.mark.parametrize(
    ("text", "seconds"), [("250ms", 0.25), ("30s", 30), ("5m", 300), ("1h", 3600), (2, 2.0)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "size"), [("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("64k", 65536), (10, 10)]
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_size_in_mib_and_bad_units() -> None:
    assert parse_size_mb("2GiB") == 2048
    with pytest.raises(ValueError, match="unknown size unit"):
        parse_size("3 parsecs")
    with pytest.raises(ValueError, match="unknown duration unit"):
        parse_duration("3 fortnights")


def test_durations_are_signed_and_finite_and_sizes_finite_and_not_negative() -> None:
    # A negative duration is read as a number, so that the setting's own bound refuses it by name.
    assert parse_duration("-5") == -5.0 and parse_duration("-250ms") == pytest.approx(-0.25)
    for value in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match="a duration must be a finite number"):
            parse_duration(value)
        with pytest.raises(ValueError, match="a size must be a finite number"):  # not OverflowError
            parse_size(value)
        with pytest.raises(ValueError, match="a size must be a finite number"):
            parse_size_mb(value)
    with pytest.raises(ValueError, match="a size cannot be negative, got '-4096'"):
        parse_size_mb("-4096")
    with pytest.raises(ValueError, match="a size cannot be negative"):
        parse_size("-1GiB")


def test_failed_result_unwraps_to_typed_errors_that_pickle() -> None:
    res = Result.failure("a1", "timeout", "too slow", traceback="tb")
    with pytest.raises(ActionTimeout) as info:
        res.unwrap()
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, TangramError)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ActionTimeout
    assert (back.action_id, back.error_type, back.remote_traceback) == ("a1", "timeout", "tb")
    assert Result(action_id="b", ok=True, value=3).unwrap() == 3
    with pytest.raises(ActionError):
        Result.failure("c", "sandbox_died", "gone").unwrap()


def test_unknown_name_error_is_a_readable_key_error() -> None:
    err = UnknownNameError("no env 'x'")
    assert isinstance(err, KeyError) and str(err) == "no env 'x'"
