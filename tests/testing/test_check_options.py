"""``patchbay check --options JSON``: the plugin's options for the whole suite, before or after KIND:NAME."""

from __future__ import annotations

import pytest
from processes import run_patchbay

from patchbay.testing import suite_for
from patchbay.testing.suite import options_env

OPTIONS = '{"starts_in_reasoning": true}'


@pytest.mark.parametrize("where", ["before", "after"])
def test_check_runs_the_suite_with_the_options_given(where: str):
    for options, passes in ((OPTIONS, True), ('{"no_such_option": 1}', False)):
        words = ["reasoning_parser:think", "--options", options]
        if where == "before":
            words = [*words[1:], words[0]]
        result = run_patchbay("check", *words, "-k", "rendered or share_state", site=None)
        assert f"conformance suite for reasoning_parser:think with options {options}" in result.stdout
        if passes:
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr
            assert "2 passed" in result.stdout, result.stdout[-2000:]
        else:  # the options reached the suite, which names them
            assert result.returncode == 1, result.stdout[-3000:] + result.stderr
            assert 'refuses the options {"no_such_option": 1}' in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize(
    ("words", "error"),
    [
        (["--options", "[1]", "reasoning_parser:think"], "--options must be a JSON object"),
        (["--options", "{nope", "reasoning_parser:think"], "--options is not JSON"),
        (["--options", "{}", "attention:reference"], "the attention suite builds plugins with their default options"),
        (["--options", "{}", "reasoning_parser:think", "--options", "{}"], "--options is given twice"),
    ],
)
def test_check_refuses_options_it_cannot_use(words: list[str], error: str):
    result = run_patchbay("check", *words, site=None)
    assert result.returncode == 2 and error in result.stderr, result.stderr


def test_the_options_given_win_over_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(options_env("tool_parser"), '{"from": "env"}')
    assert suite_for("tool_parser", "hermes")().given_options() == {"from": "env"}
    assert suite_for("tool_parser", "hermes", {"given": 1})().given_options() == {"given": 1}
    monkeypatch.setenv(options_env("tool_parser"), "[1]")
    with pytest.raises(pytest.fail.Exception, match="PATCHBAY_TEST_TOOL_PARSER_OPTIONS must hold a JSON object"):
        suite_for("tool_parser", "hermes")().given_options()
