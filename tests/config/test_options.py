"""A field that is also a flag (``psserver.config.options``): the choices its flag offers are the
ones a configuration built in code is held to, and its value parsers refuse bad text in one line."""

from __future__ import annotations

import dataclasses

import pytest

from psserver.config import EmbeddingConfig, ServerConfig, TrainerConfig
from psserver.config.options import comma_list, finite_float, flag_of, id_count, option_of, path_value, power_of_two

WITH_CHOICES = [(cls, f) for cls in (ServerConfig, TrainerConfig, EmbeddingConfig) for f in dataclasses.fields(cls)
                if option_of(f) is not None and option_of(f).choices is not None]


def test_the_fields_with_choices_are_found():
    assert {f.name for cls, f in WITH_CHOICES if cls is TrainerConfig} >= {"transport", "overlap", "step", "compute"}


@pytest.mark.parametrize(("cls", "f"), WITH_CHOICES, ids=lambda x: getattr(x, "__name__", getattr(x, "name", "")))
def test_a_value_outside_the_flags_choices_is_refused_in_code_too(cls, f):
    choices = option_of(f).choices
    with pytest.raises(ValueError, match=f"^{flag_of(f)} must be one of {', '.join(choices)}, got 'nope'$"):
        cls(**{f.name: "nope"})
    for choice in choices:  # each is taken, or refused for another reason (--compute server needs --model)
        try:
            cls(**{f.name: choice})
        except ValueError as e:
            assert "must be one of" not in str(e), e


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "x"])
def test_finite_float_refuses(text):
    with pytest.raises(ValueError):
        finite_float(text)


def test_small_parsers():
    assert comma_list("cpu, cuda:0,") == ["cpu", "cuda:0"] and comma_list(" ") is None
    assert power_of_two(1 << 40) == "2^40" and power_of_two(20_000) == "20000"
    assert id_count("2^40") == 1 << 40
    with pytest.raises(ValueError, match="empty path"):
        path_value(" ")
