"""The plugin registry, used the way plugin authors, operators and tests use it.

Third-party plugins are simulated with real (tiny) distributions: a
``*.dist-info`` directory with ``METADATA`` and ``entry_points.txt`` next to
the plugin's modules, exactly what ``pip install`` leaves behind, so entry
points carry their distribution's name and version.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from fake_distributions import write_dist_info

from patchbay import hookimpl
from patchbay.contract.registry import (
    KINDS,
    PluginConflictError,
    PluginError,
    PluginLoadError,
    Registry,
    UnknownPluginError,
    kind_of,
    parse_reference,
)
from patchbay.interfaces import Sampler, SamplerCapabilities, SamplerOutput

SAMPLER_MODULE = """
from patchbay.interfaces import Sampler, SamplerOutput


class FirstTokenSampler(Sampler):
    '''Always token 0.'''

    def sample(self, logits, metadata):
        return SamplerOutput(sampled_token_ids=logits[:, :1].long() * 0)


class SecondTokenSampler(FirstTokenSampler):
    '''Always token 0 as well, under another name.'''


class NotASampler:
    '''A class that implements no patchbay interface.'''
"""


class FakeSite:
    """A directory on ``sys.path`` where a test writes plugin modules and installs fake distributions.

    Module sources and entry-point values may say ``{pkg}``: it becomes this
    test's own import package, so tests never share a cached module.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.package = f"fake_plugins_{uuid.uuid4().hex[:10]}"
        (root / self.package).mkdir()
        (root / self.package / "__init__.py").write_text("")

    def module(self, name: str, source: str) -> str:
        """Write module ``{pkg}.name`` and return its dotted name."""
        path = self.root / self.package / f"{name}.py"
        path.write_text(textwrap.dedent(source).replace("{pkg}", self.package))
        return f"{self.package}.{name}"

    def hooks(self, name: str, body: str) -> str:
        """Write a hooks module: ``from patchbay import hookimpl`` followed by ``body``."""
        return self.module(name, "from patchbay import hookimpl\n\n" + textwrap.dedent(body))

    def distribution(
        self, name: str, version: str, entry_points: dict[str, str]
    ) -> list[importlib.metadata.EntryPoint]:
        """Install distribution ``name`` with these ``patchbay`` entry points; return them (with ``.dist`` set)."""
        values = {ep_name: value.replace("{pkg}", self.package) for ep_name, value in entry_points.items()}
        dist_info = write_dist_info(self.root, name, version, values)
        return list(importlib.metadata.Distribution.at(dist_info).entry_points.select(group="patchbay"))

    def imported(self, module: str) -> bool:
        return module.replace("{pkg}", self.package) in sys.modules


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fake = FakeSite(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield fake
    for name in [name for name in sys.modules if name.startswith(fake.package)]:
        del sys.modules[name]


@pytest.fixture
def two_samplers(site: FakeSite) -> list[importlib.metadata.EntryPoint]:
    """Distribution ``good-plugin`` 1.2.0 registering samplers ``first`` and ``second`` lazily."""
    site.module("impl", SAMPLER_MODULE)
    site.hooks(
        "good_hooks",
        """
        @hookimpl
        def register_samplers(register):
            register("first", "{pkg}.impl:FirstTokenSampler", description="always token 0")
            register("second", "{pkg}.impl:SecondTokenSampler")
    """,
    )
    return site.distribution("good-plugin", "1.2.0", {"good": "{pkg}.good_hooks"})


# -- built-in plugins --------------------------------------------------------------------------


def test_builtin_plugins_register_through_the_patchbay_entry_points():
    registry = Registry.from_entry_points()

    greedy = registry.get("sampler", "greedy")
    assert greedy.origin.distribution == "patchbay"
    assert greedy.origin.version == importlib.metadata.version("patchbay")
    assert greedy.target_path == "patchbay.plugins.samplers.greedy:GreedySampler"
    assert issubclass(registry.resolve("sampler", "greedy"), Sampler)
    assert {"reference", "torch_sdpa"} <= set(registry.names("attention"))
    assert "common" in registry.names("attention_metadata_builder")
    assert [f for f in registry.failures if f.origin.distribution == "patchbay"] == []


def test_loading_the_registry_imports_no_implementation_and_no_torch():
    # A fresh interpreter: nothing imported by other tests can hide what loading imports.
    script = (
        "import json, sys\n"
        "from patchbay.contract.registry import Registry\n"
        "registry = Registry.from_entry_points()\n"
        "targets = [r.target_path.partition(':')[0] for r in registry.registrations()]\n"
        "print(json.dumps({'names': len(targets), 'torch': 'torch' in sys.modules,\n"
        "                  'imported': [t for t in targets if t in sys.modules]}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["names"] > 0
    assert report["imported"] == [], "registration imported implementation modules"
    assert report["torch"] is False, "loading the registry imported torch"


def test_an_installed_third_party_distribution_registers_every_kind_lazily(plugin_site):
    script = (
        "import json, sys\n"
        "from patchbay.contract.registry import Registry\n"
        "registry = Registry.from_entry_points(deny=['patchbay-broken-plugin', 'patchbay-duplicate-plugin'])\n"
        "rows = [(r.reference, r.origin.distribution, r.origin.version) for r in registry.registrations()\n"
        "        if r.origin.plugin == 'example']\n"
        "print(json.dumps({'rows': rows, 'torch': 'torch' in sys.modules,\n"
        "                  'example_modules': sorted(m for m in sys.modules if m.startswith('patchbay_example'))}))\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("PATCHBAY_")}
    env["PYTHONPATH"] = str(plugin_site)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)

    assert sorted(report["rows"]) == sorted(
        [
            [reference, "patchbay-example-plugin", "0.3.1"]
            for reference in (
                "attention:example_dense",
                "attention_metadata_builder:example_passthrough",
                "drafter:example_repeat",
                "sampler:example_argmax",
                "sampler:example_verify",
                "kv_connector:example_memory",
                "structured_output:example_choice",
                "architecture:example_gpt_neo",
                "pooler:example_max",
                "weight_format:example_int4",
            )
        ]
    )
    assert report["example_modules"] == ["patchbay_example", "patchbay_example.hooks"]
    assert report["torch"] is False


# -- adding plugins in-process (how tests and embedders do it) ---------------------------------


class ConstantSampler(Sampler):
    """Always picks token 0."""

    capabilities = SamplerCapabilities(supported_params=frozenset(), supports_random=False)

    def sample(self, logits, metadata):
        return SamplerOutput(sampled_token_ids=logits[:, :1].long() * 0)


class ConstantSamplerPlugin:
    """A plugin object, as a test or an application would register one for a while."""

    @hookimpl
    def register_samplers(self, register):
        register("constant", ConstantSampler, description="token 0, always")


@pytest.fixture
def registry_with_constant_sampler():
    registry = Registry()
    registry.add_plugin(ConstantSamplerPlugin(), name="constant-plugin")
    yield registry
    registry.remove_plugin("constant-plugin")


def test_add_plugin_registers_a_plugin_object_in_process(registry_with_constant_sampler):
    registration = registry_with_constant_sampler.get("sampler", "constant")
    assert registration.origin.plugin == "constant-plugin"
    assert registration.origin.distribution == "<local>"
    assert registration.description == "token 0, always"
    assert registry_with_constant_sampler.resolve("sampler", "constant") is ConstantSampler
    assert registry_with_constant_sampler.names("sampler") == ["constant"]


def test_remove_plugin_drops_its_registrations():
    registry = Registry()
    registry.add_plugin(ConstantSamplerPlugin(), name="constant-plugin")
    registry.remove_plugin("constant-plugin")
    with pytest.raises(UnknownPluginError):
        registry.get("sampler", "constant")
    registry.add_plugin(ConstantSamplerPlugin(), name="constant-plugin")  # and it can come back
    assert registry.names("sampler") == ["constant"]


def test_adding_two_plugins_under_one_name_is_an_error(registry_with_constant_sampler):
    with pytest.raises(PluginConflictError, match="'constant-plugin' is already loaded"):
        registry_with_constant_sampler.add_plugin(ConstantSamplerPlugin(), name="constant-plugin")


# -- containment of broken plugins ---------------------------------------------------------------


@pytest.fixture
def faulty_hook(site: FakeSite) -> list[importlib.metadata.EntryPoint]:
    """Distribution ``faulty-plugin`` 2.0: registers one sampler, then its hook raises."""
    site.hooks(
        "faulty_hooks",
        """
        @hookimpl
        def register_samplers(register):
            register("half_registered", "{pkg}.impl:FirstTokenSampler")
            raise RuntimeError("no GPU found during registration")
    """,
    )
    return site.distribution("faulty-plugin", "2.0", {"faulty": "{pkg}.faulty_hooks"})


def test_a_plugin_whose_hook_raises_is_reported_and_the_others_load(two_samplers, faulty_hook):
    registry = Registry.from_entry_points(entry_points=[*faulty_hook, *two_samplers])

    (failure,) = registry.failures
    assert failure.origin.plugin == "faulty"
    assert failure.origin.distribution == "faulty-plugin"
    assert failure.origin.version == "2.0"
    assert failure.error == "RuntimeError: no GPU found during registration"
    assert "faulty_hooks.py" in failure.traceback_summary
    assert "faulty-plugin 2.0" in str(failure)
    assert registry.names("sampler") == ["first", "second"]  # nothing of the faulty plugin is kept


def test_a_plugin_that_fails_to_import_is_reported_and_the_others_load(site, two_samplers):
    site.module("missing_dependency", "import a_module_that_is_not_installed_anywhere\n")
    broken = site.distribution("needs-more-plugin", "0.1", {"needs_more": "{pkg}.missing_dependency"})

    registry = Registry.from_entry_points(entry_points=[*broken, *two_samplers])

    (failure,) = registry.failures
    assert failure.origin.distribution == "needs-more-plugin"
    assert failure.error.startswith("ModuleNotFoundError: No module named 'a_module_that_is_not_installed_anywhere'")
    assert registry.names("sampler") == ["first", "second"]


def test_strict_mode_turns_a_failing_plugin_into_an_error(two_samplers, faulty_hook):
    with pytest.raises(PluginLoadError, match=r"faulty-plugin 2\.0.*RuntimeError: no GPU found"):
        Registry.from_entry_points(strict=True, entry_points=[*faulty_hook, *two_samplers])


def test_a_hook_with_the_wrong_signature_is_reported(site, two_samplers):
    site.hooks(
        "misnamed_argument",
        """
        @hookimpl
        def register_samplers(callback):
            callback("never", "{pkg}.impl:FirstTokenSampler")
    """,
    )
    wrong = site.distribution("wrong-signature-plugin", "1.0", {"wrong": "{pkg}.misnamed_argument"})

    registry = Registry.from_entry_points(entry_points=[*wrong, *two_samplers])

    (failure,) = registry.failures
    assert failure.origin.distribution == "wrong-signature-plugin"
    assert "callback" in failure.error
    assert registry.names("sampler") == ["first", "second"]


@pytest.mark.parametrize(
    ("registration", "complaint"),
    [
        ('register("Not Valid", "{pkg}.impl:FirstTokenSampler")', "invalid sampler name 'Not Valid'"),
        ('register("", "{pkg}.impl:FirstTokenSampler")', "invalid sampler name ''"),
        ('register("no_colon", "{pkg}.impl.FirstTokenSampler")', "expected a class or a 'module:Class' string"),
        ('register("not_a_target", 42)', "expected a class or a 'module:Class' string"),
    ],
)
def test_invalid_names_and_targets_are_rejected(site, registration, complaint):
    site.module("impl", SAMPLER_MODULE)
    site.hooks(
        "invalid",
        f"""
        @hookimpl
        def register_samplers(register):
            {registration}
    """,
    )
    entry_points = site.distribution("sloppy-plugin", "0.0.1", {"sloppy": "{pkg}.invalid"})

    registry = Registry.from_entry_points(entry_points=entry_points)
    (failure,) = registry.failures
    assert complaint in failure.error
    assert registry.names("sampler") == []

    with pytest.raises(PluginLoadError, match=complaint.replace("(", r"\(")):
        Registry.from_entry_points(strict=True, entry_points=entry_points)


@pytest.fixture
def typo_hook(site: FakeSite) -> list[importlib.metadata.EntryPoint]:
    """Distribution ``typo-plugin`` 0.2, whose hook is misspelled ``register_sampler``."""
    site.hooks(
        "typo_hooks",
        """
        @hookimpl
        def register_sampler(register):  # the hook is register_samplers
            register("never_registered", "{pkg}.impl:FirstTokenSampler")
    """,
    )
    return site.distribution("typo-plugin", "0.2", {"typo": "{pkg}.typo_hooks"})


def test_a_misspelled_hook_is_not_silently_ignored(two_samplers, typo_hook):
    # pluggy accepts an implementation of an unknown hook at registration; check_pending() after
    # loading is what catches it, so the plugin's registrations cannot quietly go missing.
    try:
        registry = Registry.from_entry_points(entry_points=[*two_samplers, *typo_hook])
    except Exception as exc:  # what pluggy's check_pending raises today
        assert "unknown hook 'register_sampler'" in str(exc)
    else:
        assert any("register_sampler" in failure.error for failure in registry.failures)


def test_a_misspelled_hook_is_contained_like_any_other_plugin_failure(two_samplers, typo_hook):
    registry = Registry.from_entry_points(entry_points=[*two_samplers, *typo_hook])

    (failure,) = registry.failures
    assert failure.origin.distribution == "typo-plugin"
    assert "register_sampler" in failure.error
    assert registry.names("sampler") == ["first", "second"]
    with pytest.raises(PluginLoadError, match="typo-plugin"):
        Registry.from_entry_points(strict=True, entry_points=[*two_samplers, *typo_hook])


# -- conflicts -------------------------------------------------------------------------------------


@pytest.fixture
def clashing(site: FakeSite, two_samplers) -> list[importlib.metadata.EntryPoint]:
    """``good-plugin`` 1.2.0 and ``rival-plugin`` 3.1 both register sampler ``first``."""
    site.hooks(
        "rival_hooks",
        """
        @hookimpl
        def register_samplers(register):
            register("first", "{pkg}.impl:SecondTokenSampler")
            register("rival_only", "{pkg}.impl:SecondTokenSampler")

        @hookimpl
        def register_drafters(register):
            register("second", "{pkg}.impl:NotADrafterButNeverResolved")  # another kind: no clash
    """,
    )
    return [*two_samplers, *site.distribution("rival-plugin", "3.1", {"rival": "{pkg}.rival_hooks"})]


def test_two_distributions_claiming_one_name_is_a_conflict_naming_both(clashing):
    registry = Registry.from_entry_points(entry_points=clashing)

    (conflict,) = registry.conflicts
    assert "sampler:first" in str(conflict)
    assert "good-plugin 1.2.0" in str(conflict) and "rival-plugin 3.1" in str(conflict)
    with pytest.raises(PluginConflictError, match=r"good-plugin 1\.2\.0.*rival-plugin 3\.1"):
        registry.get("sampler", "first")
    with pytest.raises(PluginConflictError):
        registry.resolve("sampler", "first")
    assert "first" not in registry.names("sampler")
    # Everything else both plugins registered is usable, including the same name of another kind.
    assert registry.names("sampler") == ["rival_only", "second"]
    assert registry.names("drafter") == ["second"]


def test_strict_mode_fails_on_a_conflict_at_load(clashing):
    with pytest.raises(PluginError, match=r"sampler:first.*good-plugin 1\.2\.0.*rival-plugin 3\.1"):
        Registry.from_entry_points(strict=True, entry_points=clashing)


def test_denying_one_side_of_a_conflict_resolves_it(clashing):
    registry = Registry.from_entry_points(deny=["rival-plugin"], entry_points=clashing)
    assert registry.conflicts == []
    assert registry.get("sampler", "first").origin.distribution == "good-plugin"


def test_two_distributions_with_the_same_entry_point_name_both_load_or_are_reported(site, two_samplers):
    site.hooks(
        "other_hooks",
        """
        @hookimpl
        def register_samplers(register):
            register("third", "{pkg}.impl:SecondTokenSampler")
    """,
    )
    same_name = site.distribution("other-plugin", "0.9", {"good": "{pkg}.other_hooks"})

    registry = Registry.from_entry_points(entry_points=[*two_samplers, *same_name])

    loaded = set(registry.names("sampler"))
    reported = " ".join(str(failure) for failure in registry.failures)
    assert {"first", "second"} <= loaded
    assert "third" in loaded or ("other-plugin" in reported and "good-plugin" in reported)


def test_removing_a_clashing_plugin_gives_the_name_back(registry_with_constant_sampler):
    registry = registry_with_constant_sampler
    registry.add_plugin(ConstantSamplerPlugin(), name="temporary-override")
    assert registry.conflicts  # both registered "constant"

    registry.remove_plugin("temporary-override")

    assert registry.resolve("sampler", "constant") is ConstantSampler


# -- lookups ---------------------------------------------------------------------------------------


def test_an_unknown_name_lists_the_available_names(two_samplers):
    registry = Registry.from_entry_points(entry_points=two_samplers)
    with pytest.raises(UnknownPluginError, match=r"no sampler named 'nope' is installed; available: first, second"):
        registry.get("sampler", "nope")
    with pytest.raises(UnknownPluginError, match="available: none"):
        registry.get("drafter", "ngram")
    with pytest.raises(LookupError):  # UnknownPluginError is a LookupError too
        registry.resolve("sampler", "nope")


def test_unknown_kinds_and_malformed_references_list_the_kinds():
    with pytest.raises(UnknownPluginError, match="unknown plugin kind 'samplers'; kinds are: attention, "):
        kind_of("samplers")
    with pytest.raises(UnknownPluginError, match="expected KIND:NAME"):
        parse_reference("greedy")
    kind, name = parse_reference("kv_connector:shared-storage")
    assert (kind, name) == (KINDS["kv_connector"], "shared-storage")


def test_registration_is_lazy_until_resolve(site):
    site.module(
        "heavy_impl",
        """
        import sys
        sys.modules[__name__].imported_once = True
        from patchbay.interfaces import Sampler, SamplerOutput

        class HeavySampler(Sampler):
            '''Pretends to load CUDA kernels at import.'''

            def sample(self, logits, metadata):
                return SamplerOutput(sampled_token_ids=logits.argmax(-1, keepdim=True))
    """,
    )
    site.hooks(
        "lazy_hooks",
        """
        @hookimpl
        def register_samplers(register):
            register("heavy", "{pkg}.heavy_impl:HeavySampler")
    """,
    )
    registry = Registry.from_entry_points(
        entry_points=site.distribution("lazy-plugin", "1.0", {"lazy": "{pkg}.lazy_hooks"})
    )

    assert registry.names("sampler") == ["heavy"]
    assert not site.imported("{pkg}.heavy_impl")
    implementation = registry.resolve("sampler", "heavy")
    assert site.imported("{pkg}.heavy_impl")
    assert implementation.__name__ == "HeavySampler"
    assert registry.resolve("sampler", "heavy") is implementation  # resolved once


def test_resolving_a_target_that_is_not_the_kind_interface_fails(site):
    site.module("impl", SAMPLER_MODULE)
    site.hooks(
        "mixed_up_hooks",
        """
        @hookimpl
        def register_samplers(register):
            register("plain_class", "{pkg}.impl:NotASampler")
            register("missing_class", "{pkg}.impl:NoSuchSampler")
            register("missing_module", "{pkg}.no_such_module:Sampler")

        @hookimpl
        def register_drafters(register):
            register("a_sampler", "{pkg}.impl:FirstTokenSampler")
    """,
    )
    registry = Registry.from_entry_points(
        entry_points=site.distribution("mixed-up-plugin", "1.0", {"mixed": "{pkg}.mixed_up_hooks"})
    )

    with pytest.raises(
        PluginLoadError,
        match=r"sampler:plain_class .*mixed-up-plugin.* not a subclass of "
        r"patchbay\.interfaces\.sampler\.SamplerBase",
    ):
        registry.resolve("sampler", "plain_class")
    with pytest.raises(PluginLoadError, match=r"not a subclass of patchbay\.interfaces\.drafter\.Drafter"):
        registry.resolve("drafter", "a_sampler")
    with pytest.raises(PluginLoadError, match="could not import .*AttributeError"):
        registry.resolve("sampler", "missing_class")
    with pytest.raises(PluginLoadError, match="could not import .*ModuleNotFoundError"):
        registry.resolve("sampler", "missing_module")


# -- allow and deny lists -----------------------------------------------------------------------


@pytest.fixture
def with_unwanted(site: FakeSite, two_samplers) -> list[importlib.metadata.EntryPoint]:
    """``good-plugin`` plus ``unwanted-plugin``, whose module must never be imported when denied."""
    site.module(
        "unwanted_hooks",
        """
        raise AssertionError("the unwanted plugin was imported although it was denied")
    """,
    )
    return [*two_samplers, *site.distribution("unwanted-plugin", "6.6.6", {"unwanted": "{pkg}.unwanted_hooks"})]


@pytest.mark.parametrize(
    "selection",
    [{"deny": ["unwanted"]}, {"deny": ["unwanted-plugin"]}, {"allow": ["good"]}, {"allow": ["good-plugin"]}],
    ids=["deny entry-point name", "deny distribution", "allow entry-point name", "allow distribution"],
)
def test_plugins_denied_or_not_allowed_are_never_imported(site, with_unwanted, selection):
    registry = Registry.from_entry_points(**selection, entry_points=with_unwanted)
    assert registry.failures == []
    assert not site.imported("{pkg}.unwanted_hooks")
    assert registry.names("sampler") == ["first", "second"]


def test_deny_a_single_implementation_by_kind_and_name(two_samplers):
    registry = Registry.from_entry_points(deny=["sampler:first"], entry_points=two_samplers)
    assert registry.names("sampler") == ["second"]


def test_allow_a_single_implementation_by_kind_and_name(two_samplers):
    registry = Registry.from_entry_points(allow=["sampler:second"], entry_points=two_samplers)
    assert registry.names("sampler") == ["second"]


def test_deny_wins_over_allow(two_samplers):
    registry = Registry.from_entry_points(allow=["good-plugin"], deny=["sampler:second"], entry_points=two_samplers)
    assert registry.names("sampler") == ["first"]


# -- why a name is missing: denied, not allowed, or its plugin failed to load --------------------------------


def test_a_denied_implementation_is_said_to_be_denied_not_missing(two_samplers):
    registry = Registry.from_entry_points(deny=["sampler:first"], entry_points=two_samplers)
    with pytest.raises(UnknownPluginError) as caught:
        registry.get("sampler", "first")
    message = str(caught.value)
    assert message.startswith("sampler:first (plugin 'good' from good-plugin 1.2.0) is denied by plugins.deny")
    assert "PATCHBAY_PLUGINS__DENY" in message and "is installed but the plugin policy keeps it out" in message


def test_an_implementation_outside_the_allow_list_is_said_to_be_not_allowed(two_samplers):
    registry = Registry.from_entry_points(allow=["sampler:second"], entry_points=two_samplers)
    with pytest.raises(
        UnknownPluginError,
        match=r"^sampler:first \(plugin 'good' from good-plugin 1\.2\.0\) is not "
        r"in plugins\.allow",
    ):
        registry.get("sampler", "first")


def test_a_missing_name_lists_the_plugins_that_were_denied_or_failed_to_import(site, with_unwanted):
    site.module("missing_dependency", "import a_module_that_is_not_installed_anywhere\n")
    broken = site.distribution("needs-more-plugin", "0.1", {"needs_more": "{pkg}.missing_dependency"})
    registry = Registry.from_entry_points(deny=["unwanted-plugin"], entry_points=[*with_unwanted, *broken])
    with pytest.raises(UnknownPluginError) as caught:
        registry.get("sampler", "from_the_unwanted_plugin")
    message = str(caught.value)
    assert "no sampler named 'from_the_unwanted_plugin' is installed; available: first, second\n" in message
    assert "plugin 'unwanted' from unwanted-plugin 6.6.6 is denied by plugins.deny" in message
    assert (
        "plugin 'needs_more' from needs-more-plugin 0.1 failed to load: ModuleNotFoundError: No module named "
        "'a_module_that_is_not_installed_anywhere'"
    ) in message
