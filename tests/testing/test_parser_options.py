"""The parser suites run every combination of a parser's finite-valued options, the defaults first."""

from __future__ import annotations

import enum
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, model_validator

from patchbay.plugins.reasoning_parsers.think import ThinkReasoningParser
from patchbay.testing.parser_checks import build_parsers, option_combinations


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class FewOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strict: bool = False
    style: Literal["a", "b"] = "a"
    limit: int = 3  # not finite: always the default


class ManyOptions(FewOptions):
    mode: Mode = Mode.FAST
    marker: Literal["x", "y", "z"] = "y"
    keep: bool | None = None


def test_every_combination_of_the_finite_options_defaults_first():
    expected = [{}, {"style": "b"}, {"strict": True}, {"strict": True, "style": "b"}]
    assert option_combinations(FewOptions, None) == expected


def test_given_options_are_fixed_and_the_rest_still_vary():
    assert option_combinations(FewOptions, {"style": "b", "limit": 7}) == [
        {"style": "b", "limit": 7},
        {"style": "b", "limit": 7, "strict": True},
    ]


def test_past_the_limit_each_option_takes_its_values_one_at_a_time():
    # 2 * 2 * 2 * 3 * 3 = 72 combinations: the defaults, then one change each.
    assert option_combinations(ManyOptions, None) == [
        {},
        {"strict": True},
        {"style": "b"},
        {"mode": "slow"},
        {"marker": "x"},
        {"marker": "z"},
        {"keep": False},
        {"keep": True},
    ]


def test_the_think_parser_is_checked_starting_in_its_reasoning_too():
    built = build_parsers(ThinkReasoningParser, None)
    assert [(combination, parser.options.starts_in_reasoning) for combination, parser in built] == [
        ({}, False),
        ({"starts_in_reasoning": True}, True),
    ]


class Exclusive(BaseModel):
    model_config = ConfigDict(extra="forbid")

    left: bool = False
    right: bool = False

    @model_validator(mode="after")
    def _not_both(self) -> Exclusive:
        if self.left and self.right:
            raise ValueError("left and right exclude each other")
        return self


class ExclusiveParser(ThinkReasoningParser):
    Options = Exclusive  # type: ignore[assignment]


def test_combinations_the_options_model_refuses_are_left_out_but_given_ones_fail():
    assert [combination for combination, _ in build_parsers(ExclusiveParser, None)] == [
        {},
        {"right": True},
        {"left": True},
    ]
    with pytest.raises(pytest.fail.Exception, match='refuses the options {"left": true, "right": true}'):
        build_parsers(ExclusiveParser, {"left": True, "right": True})
