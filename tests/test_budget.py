import math

import pytest
from hypothesis import given, strategies as st

from fxremat.budget import parse_budget


@pytest.mark.parametrize("text, expected", [
    ("800MiB", 800 * 2**20), ("1.5GB", 1_500_000_000), ("2 GiB", 2 * 2**30), ("512 kB", 512_000),
    ("1000 B", 1000), ("3g", 3 * 2**30), (4096, 4096),
])
def test_bytes(text, expected):
    assert parse_budget(text).bytes == expected


def test_fraction_and_min():
    assert parse_budget(0.5).fraction == 0.5
    assert parse_budget(1.0).resolve(1000) == 1000
    assert parse_budget(0.25).resolve(1000) == 250
    assert parse_budget("min").minimum and parse_budget(" MIN ").resolve(10) is None


@pytest.mark.parametrize("bad", [-1, 0, 0.0, -0.5, 1.5, math.nan, math.inf, "12 parsecs", "", "MiB", "-3MiB", "0 B"])
def test_bad_values_name_the_value(bad):
    with pytest.raises(ValueError) as info:
        parse_budget(bad)
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)


@pytest.mark.parametrize("bad", [None, [1], True, b"1GB", {"a": 1}])
def test_bad_types(bad):
    with pytest.raises(TypeError, match="budget"):
        parse_budget(bad)


@given(st.text(max_size=20))
def test_any_text_parses_or_raises_value_error(text):
    try:
        budget = parse_budget(text)
    except ValueError:
        return
    assert budget.minimum or budget.bytes >= 1
