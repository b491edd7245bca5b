"""The conformance kit, used as a third-party plugin author uses it, and shown to catch bad plugins.

Two ways to point a suite at a plugin:

* installed plugin: subclass the kind's suite and set ``plugin_name`` (the
  "few lines" of a third party's test file).  Here those files run with
  ``pytester`` in a subprocess that sees the plugin packages of ``plugin_site``.
* plugin not installed: also override the ``patchbay_registry`` fixture with
  a :class:`Registry` to which the plugin's hooks were added (the classes at
  the end of this module run that way, in this process).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patchbay.contract.registry import Registry
from patchbay.testing import (
    ArchitectureSuite,
    DrafterSuite,
    KVConnectorSuite,
    MetadataBuilderSuite,
    SamplerSuite,
    WeightFormatSuite,
)
from patchbay.testing.suite import PluginSuite
from fake_distributions import write_dist_info
from repo_paths import DISTRIBUTIONS

pytest_plugins = ["pytester"]

EXAMPLE_SOURCE = DISTRIBUTIONS / "example_plugin"

# The "few lines" a third party writes to test its installed plugin with the kit.
THIRD_PARTY_TEST_FILE = """
from patchbay.testing import ArchitectureSuite, DrafterSuite, KVConnectorSuite, MetadataBuilderSuite, SamplerSuite
from patchbay.testing.tiny_models import tiny_checkpoint
from patchbay_example.architecture import TINY_GPT_NEO


class TestExampleArgmax(SamplerSuite):
    plugin_name = "example_argmax"


class TestExampleRepeat(DrafterSuite):
    plugin_name = "example_repeat"
    run_end_to_end = False  # tests/plugins/spec_decode/test_drafters.py covers the model run; keep this fast


class TestExampleMemory(KVConnectorSuite):
    plugin_name = "example_memory"
    run_end_to_end = False  # its engine runs are covered by `patchbay check` in tests/entrypoints/test_cli.py


class TestExamplePassthrough(MetadataBuilderSuite):
    plugin_name = "example_passthrough"


class TestExampleGPTNeo(ArchitectureSuite):
    plugin_name = "example_gpt_neo"

    def tiny_checkpoint(self, architecture):
        return tiny_checkpoint(architecture, TINY_GPT_NEO)
"""

# A distribution of deliberately bad samplers, each wrong in exactly one way the kit checks.
BAD_SAMPLERS = '''
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import Sampler, SamplerCapabilities, SamplerOutput


class _Argmax(Sampler):
    """Argmax, greedy only, no parameters."""

    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities(supported_params=frozenset(),
                                                                      supports_random=False)

    def sample(self, logits, metadata):
        return SamplerOutput(sampled_token_ids=logits.argmax(-1, keepdim=True))


class NoDefaultsSampler(_Argmax):
    """Its options have a required key, so an empty YAML section is invalid."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        vocab_file: str


class LenientOptionsSampler(_Argmax):
    """Its options ignore unknown keys, so typos in YAML pass silently."""

    class Options(BaseModel):
        top_k: int = 0


class ValidateIgnoresCapabilitiesSampler(_Argmax):
    """Declares greedy-only but its validate accepts everything."""

    @classmethod
    def validate(cls, config):
        return []


class ValidateRejectsEverythingSampler(_Argmax):
    """Declares CPU float32 support but its validate refuses every configuration."""

    @classmethod
    def validate(cls, config):
        return ["not today"]


class UndocumentedSampler(_Argmax):
    pass


class DeclaredGapSampler(NoDefaultsSampler):
    """Like NoDefaultsSampler, but the plugin class declares the gap itself."""

    known_gaps = {"test_options_have_defaults": "needs a vocab file; there is no sensible default"}
'''

BAD_EAGER_IMPL = '''
from patchbay.interfaces import Sampler, SamplerCapabilities, SamplerOutput


class EagerSampler(Sampler):
    """A fine sampler whose plugin imports it while registering."""

    capabilities = SamplerCapabilities(supported_params=frozenset(), supports_random=False)

    def sample(self, logits, metadata):
        return SamplerOutput(sampled_token_ids=logits.argmax(-1, keepdim=True))
'''

BAD_HOOKS = """
from patchbay import hookimpl

import bad_eager_impl  # imports an implementation at registration: the kit must catch this


@hookimpl
def register_samplers(register):
    register("bad_no_defaults", "bad_samplers:NoDefaultsSampler")
    register("bad_lenient_options", "bad_samplers:LenientOptionsSampler")
    register("bad_validate_ignores_capabilities", "bad_samplers:ValidateIgnoresCapabilitiesSampler")
    register("bad_validate_rejects_everything", "bad_samplers:ValidateRejectsEverythingSampler")
    register("bad_undocumented", "bad_samplers:UndocumentedSampler")
    register("declared_gap", "bad_samplers:DeclaredGapSampler")
    register("bad_eager", "bad_eager_impl:EagerSampler")
"""

OUTCOME_LINE = re.compile(
    r"^\S+::(\w+)::(\w+)(?:\[[^\]]*\])? (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)\b", re.MULTILINE
)


def outcomes(result: pytest.RunResult) -> dict[tuple[str, str], set[str]]:
    """(class, test) -> outcomes, from a ``-v`` run (a parametrized test may have several)."""
    found: dict[tuple[str, str], set[str]] = {}
    for suite, test, outcome in OUTCOME_LINE.findall(result.stdout.str()):
        found.setdefault((suite, test), set()).add(outcome)
    return found


def kit_tests(suite: type[PluginSuite]) -> set[str]:
    return {name for name in dir(suite) if name.startswith("test_")}


@pytest.fixture
def third_party(pytester: pytest.Pytester, plugin_site: Path, example_only_env, monkeypatch) -> pytest.Pytester:
    """A pytester whose subprocess runs see the example plugin and a ``bad-samplers`` 0.0.1 distribution."""
    for key in [key for key in os.environ if key.startswith("PATCHBAY_")]:
        monkeypatch.delenv(key)
    for key, value in example_only_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", str(plugin_site))  # pytester prepends its own directory
    pytester.makepyfile(bad_samplers=BAD_SAMPLERS, bad_eager_impl=BAD_EAGER_IMPL, bad_hooks=BAD_HOOKS)
    write_dist_info(pytester.path, "bad-samplers", "0.0.1", {"bad": "bad_hooks"})
    return pytester


def run_suites(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makepyfile(test_plugin_conformance=textwrap.dedent(source))
    return pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")


# -- an installed third-party plugin ---------------------------------------------------------------


def test_a_few_lines_run_the_whole_kit_against_an_installed_plugin(third_party):
    result = run_suites(third_party, THIRD_PARTY_TEST_FILE)
    found = outcomes(result)

    for suite_name, suite in [
        ("TestExampleArgmax", SamplerSuite),
        ("TestExampleRepeat", DrafterSuite),
        ("TestExampleMemory", KVConnectorSuite),
        ("TestExamplePassthrough", MetadataBuilderSuite),
        ("TestExampleGPTNeo", ArchitectureSuite),
    ]:
        ran = {test: found.get((suite_name, test)) for test in kit_tests(suite)}
        assert None not in ran.values(), f"{suite_name}: kit tests that never ran: {ran}"
        # Not vacuous: every registration-level check passed rather than skipped; numeric checks skip only by
        # capability (example_argmax is greedy-only, so its random-sampling checks skip), and some of them pass.
        registration_level = kit_tests(PluginSuite)
        assert all(ran[test] == {"PASSED"} for test in registration_level), f"{suite_name}: {ran}"
        numeric = {test: outcome for test, outcome in ran.items() if test not in registration_level}
        assert all(outcome <= {"PASSED", "SKIPPED"} for outcome in numeric.values()), f"{suite_name}: {ran}"
        if numeric:
            assert any("PASSED" in outcome for outcome in numeric.values()), f"{suite_name}: {ran}"
    assert found[("TestExampleArgmax", "test_greedy_rows_take_the_argmax")] == {"PASSED"}
    assert result.ret == 0, result.stdout.str()[-3000:]


# -- bad plugins fail the checks they break, and only those -----------------------------------------


BAD_PLUGIN_TESTS = """
from patchbay.testing import SamplerSuite


class TestNoDefaults(SamplerSuite):
    plugin_name = "bad_no_defaults"


class TestLenientOptions(SamplerSuite):
    plugin_name = "bad_lenient_options"


class TestValidateIgnoresCapabilities(SamplerSuite):
    plugin_name = "bad_validate_ignores_capabilities"


class TestValidateRejectsEverything(SamplerSuite):
    plugin_name = "bad_validate_rejects_everything"


class TestUndocumented(SamplerSuite):
    plugin_name = "bad_undocumented"


class TestEagerRegistration(SamplerSuite):
    plugin_name = "bad_eager"
"""

EXPECTED_FAILURE = {
    "TestNoDefaults": "test_options_have_defaults",
    "TestLenientOptions": "test_options_reject_unknown_keys",
    "TestValidateIgnoresCapabilities": "test_validate_rejects_what_capabilities_exclude",
    "TestValidateRejectsEverything": "test_validate_accepts_a_supported_config",
    "TestUndocumented": "test_is_documented",
    "TestEagerRegistration": "test_registration_has_no_side_effects",
}


def test_each_bad_plugin_fails_exactly_the_check_it_breaks(third_party):
    result = run_suites(third_party, BAD_PLUGIN_TESTS)
    found = outcomes(result)

    registration_level = kit_tests(PluginSuite)
    for suite_name, failing_test in EXPECTED_FAILURE.items():
        for test in kit_tests(SamplerSuite):
            outcome = found.get((suite_name, test))
            if test == failing_test:
                assert outcome == {"FAILED"}, (suite_name, test, outcome)
            elif test in registration_level:
                assert outcome == {"PASSED"}, (suite_name, test, outcome)
            else:  # numeric checks: these bad plugins are greedy-only, so random-sampling checks skip
                assert outcome is not None and outcome <= {"PASSED", "SKIPPED"}, (suite_name, test, outcome)
    output = result.stdout.str()
    assert "it imported the implementation module bad_eager_impl" in output
    assert "Options() must be constructible with no keys" in output
    assert "validate accepted a config outside its capabilities" in output
    assert result.ret != 0


def test_a_suite_that_names_no_plugin_or_a_missing_one_does_not_pass(third_party):
    result = run_suites(
        third_party,
        """
        from patchbay.testing import SamplerSuite


        class TestForgotThePluginName(SamplerSuite):
            pass


        class TestPluginNotInstalled(SamplerSuite):
            plugin_name = "not_installed_anywhere"
    """,
    )
    found = outcomes(result)
    assert {outcome for outcomes_of_test in found.values() for outcome in outcomes_of_test} == {"ERROR"}
    assert len(found) == 2 * len(kit_tests(SamplerSuite))
    output = result.stdout.str()
    assert "TestForgotThePluginName must set plugin_name or override the plugin_class fixture" in output
    assert "no sampler named 'not_installed_anywhere' is installed; available: " in output


# -- known gaps ----------------------------------------------------------------------------------------


def test_known_gaps_turn_failures_into_expected_failures_and_stale_gaps_fail(third_party):
    result = run_suites(
        third_party,
        """
        from patchbay.testing import SamplerSuite


        class TestGapListedByTheTestFile(SamplerSuite):
            plugin_name = "bad_no_defaults"
            known_gaps = {"test_options_have_defaults": "needs a vocab file; there is no sensible default"}


        class TestGapDeclaredByThePluginClass(SamplerSuite):
            plugin_name = "declared_gap"


        class TestStaleGap(SamplerSuite):
            plugin_name = "example_argmax"
            known_gaps = {"test_options_have_defaults": "fixed in 0.3.0, entry left behind"}
    """,
    )
    found = outcomes(result)
    assert found[("TestGapListedByTheTestFile", "test_options_have_defaults")] == {"XFAIL"}
    assert found[("TestGapDeclaredByThePluginClass", "test_options_have_defaults")] == {"XFAIL"}
    # Strict: a known gap that passes fails the run, so the stale entry gets removed.
    assert found[("TestStaleGap", "test_options_have_defaults")] == {"FAILED"}
    assert "[XPASS(strict)] known gap: fixed in 0.3.0, entry left behind" in result.stdout.str()
    # The gap is about one test: the others ran and passed.
    assert found[("TestGapListedByTheTestFile", "test_options_reject_unknown_keys")] == {"PASSED"}
    counts = result.parseoutcomes()
    assert (counts.get("xfailed"), counts.get("failed")) == (2, 1), counts
    assert counts["passed"] >= 3 * len(kit_tests(PluginSuite)) - 3, counts


def test_a_plugin_class_gap_applies_when_the_registry_fixture_is_overridden(third_party):
    result = run_suites(
        third_party,
        """
        import pytest

        from patchbay import hookimpl
        from patchbay.contract.registry import Registry
        from patchbay.testing import SamplerSuite

        from bad_samplers import DeclaredGapSampler


        class LocalPlugin:
            @hookimpl
            def register_samplers(self, register):
                register("local_gap", DeclaredGapSampler)


        class TestLocalPluginWithDeclaredGap(SamplerSuite):
            plugin_name = "local_gap"

            @pytest.fixture
            def patchbay_registry(self):
                registry = Registry()
                registry.add_plugin(LocalPlugin(), name="local")
                return registry
    """,
    )
    assert outcomes(result)[("TestLocalPluginWithDeclaredGap", "test_options_have_defaults")] == {"XFAIL"}


# -- a plugin that is not installed: override the registry fixture (runs in this process) --------------


@pytest.fixture(scope="module")
def example_registry() -> Registry:
    """A registry holding only the example plugin's hooks, imported from its source tree."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLE_SOURCE))
        import patchbay_example.hooks

        registry = Registry()
        registry.add_plugin(patchbay_example.hooks, name="example")
        yield registry


class UsesExampleRegistry:
    @pytest.fixture
    def patchbay_registry(self, example_registry: Registry) -> Registry:
        return example_registry


class TestExampleArgmaxInProcess(UsesExampleRegistry, SamplerSuite):
    plugin_name = "example_argmax"


class TestExampleRepeatInProcess(UsesExampleRegistry, DrafterSuite):
    plugin_name = "example_repeat"


class TestExampleMemoryInProcess(UsesExampleRegistry, KVConnectorSuite):
    plugin_name = "example_memory"


class TestExamplePassthroughInProcess(UsesExampleRegistry, MetadataBuilderSuite):
    plugin_name = "example_passthrough"


class TestExampleInt4InProcess(UsesExampleRegistry, WeightFormatSuite):
    plugin_name = "example_int4"


def test_in_process_suites_really_use_the_overridden_registry(example_registry):
    assert example_registry.resolve("sampler", "example_argmax").__module__ == "patchbay_example.sampler"
    assert sys.modules["patchbay_example.sampler"].__file__.startswith(str(EXAMPLE_SOURCE))


# -- deliberately defective plugins: each used to pass `patchbay check`, each must now fail it ---------------

DEFECTIVE_SOURCE = DISTRIBUTIONS / "defective_plugin"


@pytest.fixture(scope="module")
def defective_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site with the example plugin and tests/distributions/defective_plugin installed (nothing else third-party)."""
    import shutil

    from processes import pip_install_into

    sources = tmp_path_factory.mktemp("defective-sources")
    copies = []
    for package in (EXAMPLE_SOURCE, DEFECTIVE_SOURCE):
        copy = sources / package.name
        shutil.copytree(package, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        copies.append(copy)
    site = tmp_path_factory.mktemp("defective-site")
    pip_install_into(site, copies)
    return site


def check_defect(
    site: Path, reference: str, *pytest_args: str, flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``patchbay check FLAGS... REFERENCE PYTEST_ARGS...`` with the defective plugin installed."""
    from processes import run_patchbay

    return run_patchbay("check", *flags, reference, *pytest_args, site=site, timeout=600)


FAILED_TEST = re.compile(r"^FAILED \S+::(\w+(?:\[[^\]]*\])?)", re.MULTILINE)

# reference -> (the kit test that must fail, a fragment of its message naming the defect)
DEFECTS = {
    # Escape: a builder that returns its first result forever passed 35/35 builder checks.
    "attention_metadata_builder:defect_stale": (
        "test_one_instance_builds_each_batch_afresh",
        "of one instance differs from a new instance's build",
    ),
    # ... and, read by a backend, 32/32 attention checks; the engine then crashed at step 2.
    "attention:defect_stale_reader": (
        "test_one_builder_serves_changing_batches",
        "step 2 of a run with one StaleBuilder instance",
    ),
    # Escape: a builder whose own custom field is wrong (only well-known field names were compared).
    "attention_metadata_builder:defect_wrong_field": (
        "test_backends_reading_it_attend_correctly",
        "attention:defect_wrong_field_reader, which reads this builder's metadata",
    ),
    # Escape: a builder no backend names skipped its only field check as "not declared" (issue #29).
    "attention_metadata_builder:defect_no_common": (
        "test_the_kits_reference_reader_attends_correctly",
        "is neither a CommonAttentionMetadata nor carries one as .common",
    ),
    # Escape: a class target skipped the hygiene check, although registering imported the implementation.
    "sampler:defect_class_target": (
        "test_registration_has_no_side_effects",
        "it imported the implementation module patchbay_defective.sampler (registered as a class)",
    ),
    # Escape: a hooks module importing torch passed with string targets.
    "sampler:defect_torch_hooks": ("test_registration_has_no_side_effects", "torch ("),
    # A hooks module writing a file while registering (a class defined in the hooks module itself).
    "sampler:defect_writes_files": ("test_registration_has_no_side_effects", "it wrote files: "),
    # Escape: a connector without the fault hook skipped every fault test.
    "kv_connector:defect_no_fault_hook": ("test_damaged_entry_is_a_load_error", "has no fault hook"),
    # Escape: check pointed `path` at a temporary directory, so the default mode went untested.
    "kv_connector:defect_default_mode": ("test_save_then_load_is_bit_exact[defaults]", "differs from the saved block"),
    # Escapes of the structured-output suite (issue #29): every kit regex and choice was ASCII, the oracle a bytes
    # pattern, the independence check advanced by a prefix whose mask did not change, compiles were never timed.
    "structured_output:defect_shared_state": (
        "test_matchers_of_one_grammar_are_independent",
        "advancing one matcher changed another matcher of the same grammar",
    ),
    "structured_output:defect_half_way": (
        "test_a_token_refused_half_way_changes_nothing",
        "half way changed the bitmask (the bytes that fitted moved the state)",
    ),
    "structured_output:defect_latin1": (
        "test_non_ascii_choice_bitmask_matches_partial_matching_on_text[multi-byte]",
        "not its text encoded as Latin-1",
    ),
    "structured_output:defect_half_sent": (
        "test_a_half_sent_character_narrows_the_mask",
        "half of é or è was sent",
    ),
    "structured_output:defect_slow_compile": (
        "test_compiles_within_the_time_bound",
        "over the kit's compile bound of 5 s",
    ),
    "structured_output:defect_racy_compile": (
        "test_concurrent_compiles_give_the_grammars_of_sequential_ones",
        "compile is not thread-safe",
    ),
    "structured_output:defect_padded_ids": (
        "test_ids_past_the_tokenizer_are_never_allowed",
        "allowed ids past the tokenizer (49152 tokens, logits 49216 wide)",
    ),
    # Escapes of the drafter suite (issue #29): drafts for skipped rows, drafts cached by batch index.
    "drafter:defect_ignores_skip": ("test_skipped_requests_get_no_drafts", "is in skip but got drafts"),
    "drafter:defect_index_cache": (
        "test_drafts_follow_requests_not_batch_rows",
        "drafts were kept by batch index from the previous step",
    ),
    # Escapes of the KV-connector suite (issue #29): nothing forged an entry, nothing ran a consumer that finishes.
    "kv_connector:defect_unauthenticated": (
        "test_damaged_entry_is_a_load_error[defaults-forged]",
        "the forged entry of block 8 was not reported as a load error",
    ),
    "kv_connector:defect_writing_consumer": (
        "test_consumer_never_writes_the_store[defaults]",
        "a consumer wrote the store",
    ),
    # Escapes of the sampler suite (issue #29): no -inf logits were ever given, logprobs were checked on greedy rows
    # only, seeded checks compared alone with batched (both restart alike).
    "sampler:defect_mean_centred": (
        "test_masked_rows_never_yield_nan_or_a_masked_token",
        "rows with -inf (masked) logits: drew masked or invalid tokens",
    ),
    "sampler:defect_logprobs_temperature": (
        "test_frequencies_hold_when_logprobs_are_requested",
        "temperature 0.6 with logprobs=2: frequencies do not match",
    ),
    "sampler:defect_restarting_seed": (
        "test_seeded_streams_advance_from_step_to_step",
        "its generator does not advance between steps",
    ),
    # Escape: request_finished True for a request with nothing to save, never reported: the engine stepped forever.
    "kv_connector:defect_holds_forever": (
        "test_request_with_nothing_to_save_is_released",
        "get_finished never reported it",
    ),
    # Architectures: a forgotten sliding window, every layer writing one layer's cache, positions counted by the model.
    "architecture:defect_forgets_window": (
        "test_greedy_tokens_match_the_reference",
        "MistralForCausalLM, each prompt alone: prompt",
    ),
    "architecture:defect_one_cache": (
        "test_layers_attend_once_as_declared_and_the_cache_holds_what_they_wrote",
        "layer 1 (model.layers.1.self_attn) attended 0 times",
    ),
    "architecture:defect_counts_positions": (
        "test_chunked_prefill_prefix_hits_and_preemption_change_nothing",
        "LlamaForCausalLM, a changing batch: prompt",
    ),
}


@pytest.mark.parametrize("reference", DEFECTS, ids=list(DEFECTS))
def test_patchbay_check_fails_each_defective_plugin_naming_the_defect(defective_site, reference):
    failing_test, message = DEFECTS[reference]
    # Only the catching test runs (-k), to keep this file fast; the example plugin passes the whole kit elsewhere.
    result = check_defect(defective_site, reference, "-k", failing_test.partition("[")[0])
    assert result.returncode != 0, result.stdout[-3000:] + result.stderr
    failed = set(FAILED_TEST.findall(result.stdout))
    assert any(test == failing_test or test.startswith(failing_test + "[") for test in failed), (
        failed,
        result.stdout[-3000:],
    )
    assert message in result.stdout, result.stdout[-4000:]
    if reference == "kv_connector:defect_default_mode":
        # Why `check` runs a connector's defaults: with `path` in a temporary directory it passes.
        assert "test_save_then_load_is_bit_exact[temp-dir] PASSED" in result.stdout, result.stdout[-3000:]


def test_a_builders_check_does_not_depend_on_other_packages_backends(defective_site):
    # The defective plugin's broken defect_foreign_reader names the example plugin's builder, which no backend of
    # its own package names: the builder is checked by the kit's reference reader, and passes (before, it failed).
    result = check_defect(
        defective_site,
        "attention_metadata_builder:example_passthrough",
        "-k",
        "reading or reader",
        flags=("--strict",),
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "test_the_kits_reference_reader_attends_correctly PASSED" in result.stdout
    assert "no attention backend of patchbay-example-plugin names 'example_passthrough'" in result.stdout
    assert "defect_foreign_reader" not in result.stdout


def test_an_unavailable_plugin_fails_check_unless_allowed_and_strict_fails_its_skips(defective_site):
    # Escape: unavailable_reason returning text skipped every behavioural check, and check exited 0.
    refused = check_defect(defective_site, "sampler:defect_unavailable")
    assert refused.returncode != 0
    assert "sampler:defect_unavailable is unavailable here: needs the (imaginary) FooAccelerator" in refused.stderr
    assert "--allow-unavailable" in refused.stderr

    allowed = check_defect(defective_site, "sampler:defect_unavailable", "-k", "greedy", flags=("--allow-unavailable",))
    assert allowed.returncode == 0, allowed.stdout[-3000:]
    assert "SKIPPED" in allowed.stdout and "unavailable: needs the (imaginary) FooAccelerator" in allowed.stdout

    strict = check_defect(
        defective_site, "sampler:defect_unavailable", "-k", "greedy", flags=("--allow-unavailable", "--strict")
    )
    assert strict.returncode != 0
    assert (
        "strict mode: a skip of a behavioural check is a failure: unavailable: needs the (imaginary) FooAccelerator"
        in strict.stdout
    ), strict.stdout[-3000:]


def test_strict_mode_accepts_skips_of_what_the_plugin_declares_it_does_not_do(defective_site):
    # example_argmax is greedy only: its random-sampling checks skip as declared limits, strict or not.
    result = check_defect(defective_site, "sampler:example_argmax", "-k", "random or greedy", flags=("--strict",))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "SKIPPED" in result.stdout and "is greedy only (supports_random is False)" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("reference", "message"),
    [
        # Escape: saving a prefix-hit block in the step it is admitted stored garbage; the warm run's text changed.
        ("kv_connector:defect_early_save", "warm run with KV connector 'defect_early_save': prompt"),
        # The same hang, inside the engine: the run fails within kv_connector.stall_timeout, naming the connector.
        ("kv_connector:defect_holds_forever", "KV connector 'defect_holds_forever' holds requests"),
        # The stale builder, inside the engine over a changing batch: it used to crash the engine at step 2.
        (
            "attention:defect_stale_reader",
            "the engine run with attention backend 'defect_stale_reader' (requests joining",
        ),
    ],
)
def test_the_engine_runs_of_the_kit_catch_what_breaks_a_real_run(defective_site, reference, message):
    test = (
        "test_engine_cold_then_warm_runs_keep_greedy_output"
        if reference.startswith("kv")
        else "test_engine_run_matches_the_reference_backend"
    )
    result = check_defect(defective_site, reference, "-k", test)
    assert result.returncode != 0
    assert message in result.stdout, result.stdout[-4000:]


# -- the engine guards the contract at run time ------------------------------------------------------------


def run_yaml(site: Path, directory: Path, body: str) -> subprocess.CompletedProcess[str]:
    """``patchbay run`` of ``body`` on the kit's tiny model (token-id prompts), with the defective plugin installed."""
    from processes import run_patchbay

    from patchbay.testing.end_to_end import tiny_model_dir

    config = directory / "run.yaml"
    config.write_text(
        textwrap.dedent(f"""\
        model: {{path: {tiny_model_dir()}, dtype: float32}}
        runtime: {{threads: 1, device: cpu}}
        attention: {{name: reference}}
        outputs: {{path: {directory / "results.jsonl"}, progress: false}}
        """)
        + textwrap.dedent(body)
    )
    return run_patchbay("run", str(config), site=site, timeout=300)


@pytest.mark.slow
def test_a_connector_holding_a_request_forever_ends_the_run_naming_it_after_writing_results(defective_site, tmp_path):
    result = run_yaml(
        defective_site,
        tmp_path,
        f"""\
        kv_connector: {{name: defect_holds_forever, stall_timeout: 2}}
        inputs:
          sampling: {{max_tokens: 3, ignore_eos: true}}
          prompts:
            - {{id: long, prompt_token_ids: {list(range(1000, 1040))}}}
            - {{id: short, prompt_token_ids: [2000, 2001, 2002, 2003, 2004, 2005]}}
        """,
    )
    assert result.returncode != 0
    assert "KV connector 'defect_holds_forever' holds requests 'short'" in result.stderr, result.stderr[-3000:]
    assert "2 s (kv_connector.stall_timeout)" in result.stderr
    *written, last = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(row["id"] for row in written) == ["long", "short"]  # both finished before the hang
    assert all(len(row["token_ids"]) == 3 for row in written)
    # patchbay run keeps the finished lines and records why the job stopped early.
    assert "defect_holds_forever" in last["error"]


@pytest.mark.slow
def test_a_drafter_proposing_an_id_outside_the_vocabulary_fails_the_run_naming_it(defective_site, tmp_path):
    result = run_yaml(
        defective_site,
        tmp_path,
        """\
        spec_decode: {name: defect_out_of_range, num_speculative_tokens: 2}
        inputs:
          sampling: {max_tokens: 4, ignore_eos: true}
          prompts:
            - {id: only, prompt_token_ids: [1000, 1001, 1002, 1003]}
        """,
    )
    # The request fails alone (the run goes on for others) and the exit status says that one failed.
    assert result.returncode == 3, result.stderr[-3000:]
    assert (
        "drafter:defect_out_of_range proposed for request 'only' token ids outside the vocabulary (0..49151): "
        "[49152]" in result.stderr
    ), result.stderr[-3000:]
    assert "IndexError" not in result.stderr
    (row,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert row["finish_reason"] == "error" and "drafter:defect_out_of_range" in row["error"]
