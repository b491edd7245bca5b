"""The conformance kit fails each defect a third-party author's parsers and resolvers slipped past it (issue 58).

Each broken fixture (``broken_parsers.py``, ``broken_resolvers.py``) is a plugin that passes every check but
one of the kit, run here directly on the fixture: the check must fail with a message that names the defect,
and the same check must pass on the correct plugin the fixture was made from.  The correct third-party
parsers of ``model_parsers.py`` pass the whole kit, so its new checks are no stricter than the contract.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import broken_parsers as bp
import broken_resolvers as br
import pytest
from model_parsers import FunctionTagToolParser, PythonicToolParser

from patchbay.interfaces import LoRAResolver, ReasoningParser, ToolParser
from patchbay.plugins.lora_resolvers.directory_resolver import DirectoryResolver
from patchbay.plugins.reasoning_parsers.think import ThinkReasoningParser
from patchbay.plugins.tool_parsers.hermes import HermesToolParser
from patchbay.testing import LoRAResolverSuite, ReasoningParserSuite, ToolParserSuite
from patchbay.testing.parser_checks import build_parsers

KIT_FAILURES = (AssertionError, pytest.fail.Exception)

TOOL_PARSER_DEFECTS = [
    pytest.param(
        bp.SharedStreamHermes,
        HermesToolParser,
        "test_streams_of_one_parser_do_not_share_state",
        r"stream\(\) returned the same object for two outputs",
        id="one stream object shared by concurrent requests",
    ),
    pytest.param(
        bp.CommaSplittingPythonic,
        PythonicToolParser,
        "test_model_written_calls_parse_to_what_they_say",
        r"add_note\(note='a, b \(c\)'.*\(calls lost\)",
        id="a regex's view of calls: commas and parentheses in strings",
    ),
    pytest.param(
        bp.EagerPythonic,
        PythonicToolParser,
        "test_text_after_and_between_calls_is_never_lost",
        r"the stream told calls the whole text does not hold",
        id="calls told at ] before the answer ends",
    ),
    pytest.param(
        bp.BraceCountingFunctionTag,
        FunctionTagToolParser,
        "test_model_written_calls_parse_to_what_they_say",
        r"find_pattern.*\(calls lost\)",
        id="the JSON's end found by counting braces",
    ),
    pytest.param(
        bp.ReencodingHermes,
        HermesToolParser,
        "test_model_written_calls_parse_to_what_they_say",
        r"arguments a model wrote as the text of a JSON object are that object",
        id="string-valued arguments passed on re-encoded",
    ),
]

REASONING_PARSER_DEFECTS = [
    pytest.param(
        bp.StreamIgnoresStartsInReasoning,
        "test_every_split_of_a_stream_adds_up_to_the_whole",
        r'^with options \{"starts_in_reasoning": true\}: streaming',
        id="starts_in_reasoning ignored when streaming",
    ),
    pytest.param(
        bp.ClassAttributeBuffer,
        "test_streams_of_one_parser_do_not_share_state",
        r"streams of one parser interfere",
        id="undecided text kept in a class attribute",
    ),
    pytest.param(
        bp.UnclosedReasoningAsContent,
        "test_an_output_cut_inside_its_reasoning_is_reasoning",
        r"an output cut inside its reasoning \(max_tokens reached\) is reasoning with an empty answer",
        id="an unclosed reasoning section returned as content",
    ),
    pytest.param(
        bp.MarkupOnlyAtTheVeryStart,
        "test_model_written_reasoning_parses_to_what_it_says",
        r"whitespace before the markup is not content",
        id="whitespace before the markup makes the reasoning content",
    ),
    pytest.param(
        bp.HasReasoningOnlyAtTheEnd,
        "test_every_split_of_a_stream_adds_up_to_the_whole",
        r"has_reasoning is False after the stream sent reasoning",
        id="has_reasoning told only at the end",
    ),
]

RESOLVER_DEFECTS = [
    pytest.param(
        br.FollowsFileLinks,
        "test_files_linked_out_of_the_store_never_resolve",
        {"which": "adapter_model.safetensors"},
        r"'files-linked', a folder whose adapter_model.safetensors links outside the store, resolved to",
        id="files that are symlinks out of the root followed",
    ),
    pytest.param(
        br.PrefixContainment,
        "test_a_name_never_reaches_outside_the_store",
        {"name": "../adapters-evil/secret"},
        r"'../adapters-evil/secret', a name that leaves the store, resolved to",
        id="str.startswith(root) as the containment test",
    ),
    pytest.param(
        br.RemembersMisses,
        "test_an_adapter_added_after_a_miss_is_found",
        {},
        r"a resolver must not remember misses",
        id="a negative answer cached forever",
    ),
    pytest.param(
        br.KeepsPrivateCopy,
        "test_an_adapter_replaced_in_place_resolves_to_its_new_files",
        {},
        r"a resolver that caches or copies adapters must check that its copy is current",
        id="a private copy never refreshed",
    ),
    pytest.param(
        br.IgnoresTheBaseModel,
        "test_an_adapter_for_another_base_model_is_refused_when_told_the_base_model",
        {},
        r"names base model 'kit-org/another-model': raise LoRAResolveError naming both",
        id="the base model told but never compared",
    ),
]


def kit_failure(check) -> str:
    """Run ``check`` (a kit check bound to its arguments); the message it fails with, or a failure if it passes."""
    with pytest.raises(KIT_FAILURES) as failure:
        check()
    value = failure.value
    return value.msg if isinstance(value, pytest.fail.Exception) else str(value)


@pytest.mark.parametrize(("broken", "correct", "check", "message"), TOOL_PARSER_DEFECTS)
def test_the_tool_parser_suite_fails_each_defect_naming_it(
    broken: type[ToolParser], correct: type[ToolParser], check: str, message: str
):
    suite = ToolParserSuite()
    getattr(suite, check)(build_parsers(correct, None))
    failed = kit_failure(lambda: getattr(suite, check)(build_parsers(broken, None)))
    assert re.search(message, failed, re.DOTALL), failed


@pytest.mark.parametrize(("broken", "check", "message"), REASONING_PARSER_DEFECTS)
def test_the_reasoning_parser_suite_fails_each_defect_naming_it(
    broken: type[ReasoningParser], check: str, message: str
):
    suite = ReasoningParserSuite()
    getattr(suite, check)(build_parsers(ThinkReasoningParser, None))
    failed = kit_failure(lambda: getattr(suite, check)(build_parsers(broken, None)))
    assert re.search(message, failed, re.DOTALL), failed


def _resolver(cls: type[LoRAResolver], suite: LoRAResolverSuite, folder: Path) -> LoRAResolver:
    return cls(cls.Options.model_validate(suite.resolver_options(folder)))


@pytest.mark.parametrize(("broken", "check", "arguments", "message"), RESOLVER_DEFECTS)
def test_the_resolver_suite_fails_each_defect_naming_it(
    broken: type[LoRAResolver], check: str, arguments: dict, message: str, tmp_path: Path
):
    suite = LoRAResolverSuite()
    folder = suite.write_store(tmp_path / "correct")
    getattr(suite, check)(resolver=_resolver(DirectoryResolver, suite, folder), adapter_folder=folder, **arguments)
    folder = suite.write_store(tmp_path / "broken")
    resolver = _resolver(broken, suite, folder)
    try:
        failed = kit_failure(lambda: getattr(suite, check)(resolver=resolver, adapter_folder=folder, **arguments))
    finally:
        if isinstance(resolver, br.KeepsPrivateCopy):
            shutil.rmtree(resolver._store)
    assert re.search(message, failed, re.DOTALL), failed


# -- correct third-party parsers pass the whole kit ---------------------------------------------------


class TestAPythonicParserPassesTheKit(ToolParserSuite):
    @pytest.fixture
    def plugin_class(self) -> type[ToolParser]:
        return PythonicToolParser


class TestAFunctionTagParserPassesTheKit(ToolParserSuite):
    @pytest.fixture
    def plugin_class(self) -> type[ToolParser]:
        return FunctionTagToolParser
