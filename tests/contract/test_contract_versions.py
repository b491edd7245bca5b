"""The versioned plugin API: what loads, what is refused and why, and what `patchbay plugins` shows."""

from __future__ import annotations

import sys
import warnings

import pytest

from patchbay import hookimpl
from patchbay.contract.registry import PluginLoadError, Registry
from patchbay.contract.versions import (
    CONTRACT_VERSIONS,
    ContractVersion,
    PluginContractWarning,
    current_version,
)
from patchbay.entrypoints.cli import main
from patchbay.interfaces import Sampler, SamplerCapabilities, SamplerOutput
from patchbay.testing import SamplerSuite
from repo_paths import DISTRIBUTIONS

LEGACY_SOURCE = DISTRIBUTIONS / "legacy_plugin"


def _sampler(version: str | None) -> type[Sampler]:
    class VersionedSampler(Sampler):
        """Greedy argmax declaring a contract version."""

        capabilities = SamplerCapabilities(supported_params=frozenset(), supports_random=False)

        def sample(self, logits, metadata):
            return SamplerOutput(sampled_token_ids=logits.argmax(-1, keepdim=True))

    if version is not None:
        VersionedSampler.contract_version = version
    return VersionedSampler


def _registry_with(version: str | None) -> Registry:
    implementation = _sampler(version)

    class Hooks:
        @hookimpl
        def register_samplers(self, register):
            register("versioned", implementation)

    registry = Registry()
    registry.add_plugin(Hooks(), name="versioned-plugin", distribution="versioned-dist", version="2.3.4")
    return registry


def test_every_built_in_declares_the_current_contract_version():
    registry = Registry.from_entry_points(allow=["patchbay"])
    built_ins = [r for r in registry.registrations() if r.origin.distribution == "patchbay"]
    assert {r.kind.name for r in built_ins} == set(CONTRACT_VERSIONS)
    for registration in built_ins:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # neither deprecated nor undeclared
            implementation = registration.resolve()
        declared = ContractVersion.parse(implementation.__dict__["contract_version"])
        current = current_version(registration.kind.name)
        assert (declared.major, declared.minor) == (current.major, current.minor), registration.reference


def test_the_current_version_loads_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _registry_with(str(current_version("sampler"))).resolve("sampler", "versioned")


@pytest.mark.parametrize(
    ("declared", "why"),
    [
        ("2.0", "the major version differs"),
        ("0.9", "the major version differs"),
        (f"1.{current_version('sampler').minor + 1}", "it needs a newer patchbay than this one"),
    ],
)
def test_an_incompatible_plugin_is_refused_naming_it_the_versions_and_the_fix(declared, why):
    with pytest.raises(PluginLoadError) as refused:
        _registry_with(declared).resolve("sampler", "versioned")
    message = str(refused.value)
    assert "sampler:versioned (plugin 'versioned-plugin' from versioned-dist 2.3.4)" in message
    assert f"built against the sampler contract {ContractVersion.parse(declared)}" in message
    assert f"this patchbay provides {current_version('sampler')}" in message
    assert why in message
    assert "fix: install a release of the plugin built for contract" in message


def test_a_version_that_is_not_one_is_refused():
    with pytest.raises(PluginLoadError, match="'one point one' is not a contract version"):
        _registry_with("one point one").resolve("sampler", "versioned")


def test_the_previous_minor_version_loads_with_a_deprecation_warning_naming_the_plugin():
    current = current_version("sampler")
    previous = f"{current.major}.{current.minor - 1}"
    with pytest.warns(DeprecationWarning, match=r"sampler:versioned \(plugin 'versioned-plugin'") as caught:
        implementation = _registry_with(previous).resolve("sampler", "versioned")
    assert f"contract {previous}.0" in str(caught[0].message)
    assert implementation.contract_version == previous


def test_a_plugin_declaring_nothing_is_treated_as_current_with_a_warning():
    with pytest.warns(PluginContractWarning, match="declares no contract_version; treated as built against"):
        _registry_with(None).resolve("sampler", "versioned")


def test_plugins_command_shows_each_plugins_contract_version(capsys):
    assert main(["plugins", "--kind", "sampler"]) == 0
    out = capsys.readouterr().out
    assert f"sampler (contract {CONTRACT_VERSIONS['sampler']}):" in out
    current = current_version("sampler")
    assert f"contract {current.major}.{current.minor}  [available]" in out
    assert main(["plugins", "--kind", "sampler", "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["plugins"]
    assert {row["name"]: row["contract_version"] for row in rows}["greedy"] == f"{current.major}.{current.minor}"


# -- a plugin package written against the previous contract keeps working -----------------------------------


@pytest.fixture(scope="module")
def legacy_registry() -> Registry:
    """A registry holding the legacy plugin package's hooks, imported from its source tree."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(LEGACY_SOURCE))
        import patchbay_legacy.hooks

        registry = Registry()
        registry.add_plugin(patchbay_legacy.hooks, name="legacy")
        yield registry


def test_the_legacy_package_declares_the_previous_minor_and_loads_with_a_warning(legacy_registry):
    with pytest.warns(DeprecationWarning, match="legacy_temperature.*contract 1.0.0"):
        implementation = legacy_registry.get("sampler", "legacy_temperature").resolve()
    assert sys.modules[implementation.__module__].__file__.startswith(str(LEGACY_SOURCE))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
class TestLegacyPluginPassesTheKit(SamplerSuite):
    """The legacy package, unchanged, still passes the current sampler suite."""

    plugin_name = "legacy_temperature"

    @pytest.fixture
    def patchbay_registry(self, legacy_registry: Registry) -> Registry:
        return legacy_registry
