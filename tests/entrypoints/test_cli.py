"""The ``patchbay`` command line, run as an operator runs it, with third-party plugins installed.

``patchbay_cli`` (tests/conftest.py) runs the installed console script in a
subprocess that sees the example, broken and duplicate plugin distributions.
``example_only_env`` denies the broken and duplicate ones for a clean registry.
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import yaml

from patchbay.contract.versions import CONTRACT_VERSIONS
from patchbay.testing import SUITES
from patchbay.testing.suite import PluginSuite

EXAMPLE_IMPLEMENTATIONS = {
    "attention": "example_dense",
    "attention_metadata_builder": "example_passthrough",
    "drafter": "example_repeat",
    "sampler": "example_argmax",
    "kv_connector": "example_memory",
}

EVERY_EXAMPLE_PLUGIN_YAML = """\
attention:
  name: example_dense
  metadata_builder: example_passthrough
  options: {scale_override: 0.125}
sampler:
  name: example_argmax
  options: {vocab_limit: 49152}
spec_decode:
  name: example_repeat
  num_speculative_tokens: 2
  rejection_sampler: example_verify
  options: {max_draft_tokens: 2}
kv_connector:
  name: example_memory
  options: {namespace: cli-test, capacity_blocks: 1024}
"""


@pytest.fixture
def write_yaml(tmp_path):
    def write(text: str, name: str = "run.yaml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


# -- patchbay plugins ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plugins_listing(patchbay_cli):
    """``patchbay plugins`` with the example, broken and duplicate plugins all installed (run once)."""
    return patchbay_cli("plugins")


def test_plugins_lists_builtin_and_third_party_plugins_with_distribution_and_version(plugins_listing):
    result = plugins_listing
    assert result.returncode == 0, result.stderr

    lines = result.stdout.splitlines()
    for kind, name in EXAMPLE_IMPLEMENTATIONS.items():
        if name == "example_argmax":
            continue  # conflicted while the duplicate plugin is installed; see the conflict test
        assert any(
            re.match(rf"\s+{name}\s+patchbay-example-plugin 0\.3\.1\s+contract 1\.1\s+\[available\]", line)
            for line in lines
        ), f"{kind}:{name} not listed with its distribution and version"
    assert any(re.match(r"\s+greedy\s+patchbay \d+\.\d+\.\d+", line) for line in lines)
    assert any(re.match(r"\s+reference\s+patchbay \d+\.\d+\.\d+", line) for line in lines)
    for kind in EXAMPLE_IMPLEMENTATIONS:
        assert f"{kind} (contract {CONTRACT_VERSIONS[kind]}):" in lines


def test_plugins_names_a_broken_plugin_with_its_error_and_still_lists_the_rest(plugins_listing):
    result = plugins_listing
    assert result.returncode == 0, result.stderr
    assert (
        "broken plugin 'broken' from patchbay-broken-plugin 0.0.1: ImportError: this plugin is broken on purpose"
    ) in result.stdout
    assert "patchbay_broken/hooks.py:3" in result.stdout  # where it broke
    assert "example_dense" in result.stdout and "greedy" in result.stdout


def test_plugins_shows_a_conflict_naming_both_distributions(plugins_listing):
    result = plugins_listing
    (conflict,) = [line for line in result.stdout.splitlines() if line.startswith("conflict:")]
    assert "sampler:example_argmax" in conflict
    assert "patchbay-duplicate-plugin 1.0.0" in conflict and "patchbay-example-plugin 0.3.1" in conflict


def test_plugins_strict_fails_on_the_broken_plugin(patchbay_cli):
    result = patchbay_cli("plugins", "--strict")
    assert result.returncode != 0
    assert "patchbay-broken-plugin 0.0.1" in result.stderr
    assert "this plugin is broken on purpose" in result.stderr


def test_plugins_strict_succeeds_once_the_broken_and_duplicate_plugins_are_denied(patchbay_cli, example_only_env):
    result = patchbay_cli("plugins", "--strict", env=example_only_env)
    assert result.returncode == 0, result.stderr
    assert "broken plugin" not in result.stdout and "conflict:" not in result.stdout
    assert re.search(r"example_argmax\s+patchbay-example-plugin 0\.3\.1", result.stdout)


def test_plugins_json_reports_plugins_failures_and_conflicts(patchbay_cli):
    result = patchbay_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)

    rows = {(row["kind"], row["name"]): row for row in report["plugins"]}
    dense = rows[("attention", "example_dense")]
    assert dense["distribution"] == "patchbay-example-plugin" and dense["version"] == "0.3.1"
    assert dense["target"] == "patchbay_example.attention:ExampleDenseBackend"
    assert dense["available"] is True and dense["reason"] is None
    assert dense["capabilities"]["supports_gqa"] is True and dense["capabilities"]["priority"] == -100
    assert rows[("kv_connector", "example_memory")]["capabilities"]["async_save"] is True
    assert rows[("drafter", "example_repeat")]["plugin"] == "example"
    assert rows[("sampler", "greedy")]["distribution"] == "patchbay"

    (failure,) = report["failures"]
    assert failure["plugin"] == "broken"
    assert (failure["distribution"], failure["version"]) == ("patchbay-broken-plugin", "0.0.1")
    assert failure["error"] == "ImportError: this plugin is broken on purpose"

    (conflict,) = report["conflicts"]
    assert (conflict["kind"], conflict["name"]) == ("sampler", "example_argmax")
    assert {claimant["distribution"] for claimant in conflict["claimants"]} == {
        "patchbay-duplicate-plugin",
        "patchbay-example-plugin",
    }
    assert "is registered twice" in conflict["message"]
    assert dense["metadata_builder"] == "common" and dense["known_gaps"] == {}


def test_plugins_kind_filter(patchbay_cli, example_only_env):
    report = json.loads(patchbay_cli("plugins", "--json", "--kind", "drafter", env=example_only_env).stdout)
    assert {row["kind"] for row in report["plugins"]} == {"drafter"}
    assert "example_repeat" in {row["name"] for row in report["plugins"]}


# -- patchbay config validate / show -------------------------------------------------------------------


def test_config_validate_accepts_a_yaml_selecting_every_example_plugin(patchbay_cli, example_only_env, write_yaml):
    path = write_yaml(EVERY_EXAMPLE_PLUGIN_YAML)
    result = patchbay_cli("config", "validate", str(path), env=example_only_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{path}: valid (0 requests)"


def test_the_yaml_plugins_section_decides_what_loads(patchbay_cli, plugin_site, write_yaml):
    clashing = write_yaml("sampler: {name: example_argmax}\n", name="clash.yaml")
    assert patchbay_cli("config", "validate", str(clashing)).returncode != 0
    resolved = write_yaml("sampler: {name: example_argmax}\nplugins: {deny: [patchbay-duplicate-plugin]}\n")
    result = patchbay_cli("config", "validate", str(resolved))
    assert result.returncode == 0, result.stderr


def test_config_validate_rejects_an_unknown_key_naming_file_and_key_path(patchbay_cli, example_only_env, write_yaml):
    path = write_yaml("sampler: {name: example_argmax}\nscheduler: {max_num_seqs: 4, max_num_seq: 8}\n")
    result = patchbay_cli("config", "validate", str(path), env=example_only_env)
    assert result.returncode != 0
    assert f"{path}: scheduler.max_num_seq: unknown key" in result.stderr


def test_config_validate_rejects_a_wrong_type_in_a_plugins_options(patchbay_cli, example_only_env, write_yaml):
    path = write_yaml("sampler:\n  name: example_argmax\n  options: {vocab_limit: all of it}\n")
    result = patchbay_cli("config", "validate", str(path), env=example_only_env)
    assert result.returncode != 0
    assert f"{path}: sampler.options.vocab_limit (plugin sampler:example_argmax): " in result.stderr
    assert "valid integer" in result.stderr and "'all of it'" in result.stderr


def test_config_validate_rejects_an_unknown_plugin_listing_the_choices(patchbay_cli, example_only_env, write_yaml):
    path = write_yaml("spec_decode: {name: example_repeet, rejection_sampler: example_verify}\n")
    result = patchbay_cli("config", "validate", str(path), env=example_only_env)
    assert result.returncode != 0
    assert f"{path}: spec_decode.name: no speculative-decoding drafter named 'example_repeet'" in result.stderr
    available = result.stderr.split("available: ", 1)[1].split("\n", 1)[0]
    assert "example_repeat" in available.split(", ")


def test_config_validate_rejects_a_conflicted_name_naming_both_distributions(patchbay_cli, write_yaml):
    path = write_yaml("sampler: {name: example_argmax}\n")
    result = patchbay_cli("config", "validate", str(path))
    assert result.returncode != 0
    assert f"{path}: sampler.name: sampler:example_argmax is registered twice" in result.stderr
    assert "patchbay-duplicate-plugin" in result.stderr and "patchbay-example-plugin" in result.stderr


def test_config_validate_names_the_set_flag_at_fault(patchbay_cli, example_only_env, write_yaml):
    path = write_yaml("sampler: {name: example_argmax}\n")
    result = patchbay_cli(
        "config", "validate", str(path), "--set", "sampler.options.vocab_limit=-3", env=example_only_env
    )
    assert result.returncode != 0
    assert (
        "--set sampler.options.vocab_limit=-3: sampler.options.vocab_limit (plugin sampler:example_argmax)"
        in result.stderr
    )


def test_config_show_prints_the_effective_config_with_overrides(patchbay_cli, example_only_env, write_yaml):
    path = write_yaml(EVERY_EXAMPLE_PLUGIN_YAML)
    result = patchbay_cli(
        "config",
        "show",
        str(path),
        "--set",
        "sampler.options.vocab_limit=100",
        env={**example_only_env, "PATCHBAY_SCHEDULER__MAX_NUM_SEQS": "8"},
    )
    assert result.returncode == 0, result.stderr
    effective = yaml.safe_load(result.stdout)
    assert effective["sampler"] == {"name": "example_argmax", "options": {"vocab_limit": 100}}  # --set
    assert effective["scheduler"]["max_num_seqs"] == 8  # env
    assert effective["kv_connector"]["options"] == {"namespace": "cli-test", "capacity_blocks": 1024}  # YAML
    assert effective["cache"]["block_size"] == 16  # default
    assert effective["plugins"]["deny"] == ["patchbay-broken-plugin", "patchbay-duplicate-plugin"]


def test_config_show_hides_the_servers_api_keys(patchbay_cli, example_only_env, write_yaml):
    """Reliability finding: ``config show`` printed ``server.api_keys`` in clear (``keys`` is a plural)."""
    path = write_yaml("server: {api_keys: [sk-distinctive-4711, sk-second-0815]}\n")
    result = patchbay_cli("config", "show", str(path), env=example_only_env)
    assert result.returncode == 0, result.stderr
    assert "distinctive-4711" not in result.stdout + result.stderr
    assert "second-0815" not in result.stdout + result.stderr
    assert yaml.safe_load(result.stdout)["server"]["api_keys"] == "***"


# -- patchbay check ----------------------------------------------------------------------------------------


def _outcomes(stdout: str) -> dict[str, set[str]]:
    """Kit test name -> its outcomes (several for a parametrized test), from pytest's ``-v`` lines."""
    found: dict[str, set[str]] = {}
    pattern = r"::\w+::(\w+)(?:\[[^\]]*\])? (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)\b"
    for match in re.finditer(pattern, stdout):
        found.setdefault(match.group(1), set()).add(match.group(2))
    return found


def _kit_tests(suite: type[PluginSuite]) -> set[str]:
    return {name for name in dir(suite) if name.startswith("test_")}


@pytest.mark.parametrize(("kind", "name"), EXAMPLE_IMPLEMENTATIONS.items(), ids=EXAMPLE_IMPLEMENTATIONS)
def test_check_runs_the_conformance_kit_against_an_example_plugin(patchbay_cli, example_only_env, kind, name):
    result = patchbay_cli("check", f"{kind}:{name}", env=example_only_env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    assert f"conformance suite for {kind}:{name}" in result.stdout

    outcomes = _outcomes(result.stdout)
    assert set(outcomes) == _kit_tests(SUITES[kind]), "every kit test of the kind ran"
    assert set().union(*outcomes.values()) <= {"PASSED", "SKIPPED"}, outcomes  # skips: capabilities it lacks
    # The checks every plugin must pass ran for real, and the summary has a line for each.
    for test in _kit_tests(PluginSuite):
        assert outcomes[test] == {"PASSED"}, (test, outcomes[test])
        assert re.search(rf"^PASSED \S+::{test}$", result.stdout, re.MULTILINE), f"no summary line for {test}"


def test_check_refuses_a_conflicted_name(patchbay_cli):
    result = patchbay_cli("check", "sampler:example_argmax")  # the duplicate plugin is not denied here
    assert result.returncode != 0
    assert "sampler:example_argmax is registered twice" in result.stderr


def test_check_an_unknown_plugin_names_the_available_ones(patchbay_cli, example_only_env):
    result = patchbay_cli("check", "sampler:nope", env=example_only_env)
    assert result.returncode != 0
    assert "no sampler named 'nope' is installed; available: " in result.stderr
    available = result.stderr.split("available: ")[1].split(", ")
    assert {"example_argmax", "greedy"} <= {name.strip() for name in available}


def test_check_a_malformed_reference_names_the_kinds(patchbay_cli, example_only_env):
    result = patchbay_cli("check", "example_argmax", env=example_only_env)
    assert result.returncode != 0
    assert (
        "expected KIND:NAME (kinds: attention, attention_metadata_builder, drafter, sampler, kv_connector, "
        "structured_output, lora_kernel, lora_resolver, tool_parser, architecture, reasoning_parser, weight_format, "
        "pooler)"
    ) in result.stderr


def test_plugins_shows_builders_known_gaps_and_what_the_policy_kept_out(patchbay_cli, example_only_env):
    report = json.loads(patchbay_cli("plugins", "--json", env=example_only_env).stdout)
    excluded = {row["what"]: row["rule"] for row in report["excluded"]}
    assert excluded["plugin 'broken' from patchbay-broken-plugin 0.0.1"] == "denied by plugins.deny"
    assert excluded["plugin 'duplicate' from patchbay-duplicate-plugin 1.0.0"] == "denied by plugins.deny"
    rows = {(row["kind"], row["name"]): row for row in report["plugins"]}
    assert all(isinstance(row["known_gaps"], dict) for row in rows.values() if row["available"])
    assert rows[("attention", "example_dense")]["known_gaps"] == {}

    listing = patchbay_cli("plugins", "-v", "--kind", "attention", env=example_only_env).stdout
    assert re.search(r"example_dense .*\n.*\n\s+metadata builder: common\n", listing), listing
    assert "not loaded: plugin 'broken' from patchbay-broken-plugin 0.0.1 is denied by plugins.deny" in listing


def test_run_validate_and_check_name_a_plugin_that_failed_to_import(patchbay_cli, write_yaml):
    path = write_yaml("sampler: {name: greedy}\n")
    warning = "patchbay: warning: plugin 'broken' from patchbay-broken-plugin 0.0.1: ImportError: this plugin is broken"
    validate = patchbay_cli("config", "validate", str(path))
    assert validate.returncode == 0 and warning in validate.stderr, validate.stderr
    check = patchbay_cli("check", "sampler:greedy", "-k", "documented")
    assert check.returncode == 0 and warning in check.stderr, check.stderr
