"""The base conformance suite every plugin kind's suite extends.

A suite is a plain pytest class.  An implementer subclasses the suite of
its kind and names the plugin::

    from patchbay.testing import SamplerSuite

    class TestMySampler(SamplerSuite):
        plugin_name = "my_sampler"

The plugin is looked up in the ``patchbay_registry`` fixture (by default
the entry-point registry, so the plugin must be installed), or supplied
directly by overriding the ``plugin_class`` fixture.  Tests that a plugin is
known to fail are listed, with reasons, in ``known_gaps`` on the suite
subclass or on the plugin class; they run as strict expected failures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel, ValidationError

from patchbay.contract.registry import KINDS, Registration, Registry
from patchbay.interfaces import Capabilities, Plugin, ServingConfig


class PluginSuite:
    """Checks every plugin must pass, whatever its kind: registration hygiene, options, capabilities."""

    kind: ClassVar[str] = ""
    """The kind under test; set by each kind's suite."""
    plugin_name: ClassVar[str | None] = None
    """The registered name of the implementation under test."""
    known_gaps: ClassVar[dict[str, str]] = {}
    """Test name -> reason, for tests this implementation is known to fail."""
    capabilities_class: ClassVar[type[Capabilities]] = Capabilities

    # -- fixtures an implementer may override -----------------------------------------------

    @pytest.fixture
    def registration(self, patchbay_registry: Registry) -> Registration:
        """The registration under test (looked up by :attr:`plugin_name`)."""
        if not self.plugin_name:
            pytest.fail(f"{type(self).__name__} must set plugin_name or override the plugin_class fixture")
        return patchbay_registry.get(self.kind, self.plugin_name)

    @pytest.fixture
    def plugin_class(self, registration: Registration) -> type[Plugin]:
        """The implementation class under test."""
        return registration.resolve()

    @pytest.fixture(autouse=True)
    def _known_gaps_of_the_plugin(self, request: pytest.FixtureRequest) -> None:
        # Gaps declared on the plugin class: read through the fixtures, so an overridden registry is honoured.
        if "plugin_class" not in request.fixturenames and not self.plugin_name:
            return
        plugin_class = request.getfixturevalue("plugin_class")
        reason = dict(plugin_class.known_gaps).get(request.node.originalname)
        if reason:
            request.node.add_marker(pytest.mark.xfail(reason=f"known gap: {reason}", strict=True))

    @pytest.fixture
    def available(self, plugin_class: type[Plugin]) -> type[Plugin]:
        """The implementation class, skipping the test when it cannot run on this machine."""
        reason = plugin_class.unavailable_reason()
        if reason:
            pytest.skip(f"unavailable: {reason}")
        return plugin_class

    # -- what each kind's suite supplies -----------------------------------------------------

    def supported_config(self, capabilities: Capabilities) -> ServingConfig:
        """A configuration inside ``capabilities`` (each kind's suite overrides)."""
        return ServingConfig(device=capabilities.devices[0], dtype=capabilities.dtypes[0])

    def unsupported_configs(self, capabilities: Capabilities) -> list[tuple[str, ServingConfig]]:
        """Configurations each outside ``capabilities`` in one respect, with a label."""
        base = self.supported_config(capabilities)
        found = []
        if "meta-device" not in capabilities.devices:
            found.append(("device", _replace(base, device="meta-device")))
        for dtype in ("float32", "bfloat16", "float16"):
            if dtype not in capabilities.dtypes:
                found.append((f"dtype {dtype}", _replace(base, dtype=dtype)))
                break
        return found

    # -- registration hygiene -----------------------------------------------------------------

    def test_resolves_to_the_kind_interface(self, plugin_class: type[Plugin]) -> None:
        interface = KINDS[self.kind].interface
        assert issubclass(plugin_class, interface), f"{plugin_class} does not implement {interface.__name__}"
        assert plugin_class.kind == self.kind

    def test_is_documented(self, plugin_class: type[Plugin]) -> None:
        assert plugin_class.__doc__ and plugin_class.__doc__.strip(), (
            f"{plugin_class.__qualname__} needs a docstring: `patchbay plugins` and the docs show it"
        )

    def test_registration_has_no_side_effects(self, plugin_class: type[Plugin], request: pytest.FixtureRequest) -> None:
        """Running the plugin's hooks must not import the implementation module or touch a device."""
        if not self.plugin_name:
            pytest.skip("the plugin class was supplied directly; there is no registration to inspect")
        registration: Registration = request.getfixturevalue("registration")
        if registration.origin.distribution == "<local>" or not isinstance(registration.target, str):
            pytest.skip("only lazy ('module:Class') registrations from installed distributions are checked")
        target_module = registration.target.partition(":")[0]
        report = _registration_report(registration.origin.plugin)
        assert report["error"] is None, f"registering plugin {registration.origin.plugin!r} failed: {report['error']}"
        if target_module != report["hook_module"]:
            assert target_module not in report["imported"], (
                f"registering {registration.reference} imported {target_module}; "
                "register a 'module:Class' string and import heavy modules in the class instead"
            )
        assert not report["cuda_initialized"], f"registering {registration.reference} initialised CUDA"

    # -- options ----------------------------------------------------------------------------

    def test_options_is_a_pydantic_model(self, plugin_class: type[Plugin]) -> None:
        assert isinstance(plugin_class.Options, type) and issubclass(plugin_class.Options, BaseModel)
        plugin_class.Options.model_json_schema()

    def test_options_have_defaults(self, plugin_class: type[Plugin]) -> None:
        try:
            plugin_class.Options()
        except ValidationError as exc:
            pytest.fail(f"Options() must be constructible with no keys (an empty YAML section): {exc}")

    def test_options_reject_unknown_keys(self, plugin_class: type[Plugin]) -> None:
        with pytest.raises(ValidationError):
            plugin_class.Options.model_validate({"no_such_option_for_conformance": 1})

    # -- capabilities and validate ----------------------------------------------------------

    def test_capabilities_are_declared(self, plugin_class: type[Plugin]) -> None:
        capabilities = plugin_class.capabilities
        assert isinstance(capabilities, self.capabilities_class), (
            f"capabilities must be a {self.capabilities_class.__name__}, got {type(capabilities).__name__}"
        )
        assert capabilities.devices, "declare at least one device"
        assert capabilities.dtypes, "declare at least one dtype"
        json.dumps(capabilities.as_dict())

    def test_unavailable_reason_is_text_or_none(self, plugin_class: type[Plugin]) -> None:
        reason = plugin_class.unavailable_reason()
        assert reason is None or (isinstance(reason, str) and reason.strip())

    def test_validate_accepts_a_supported_config(self, plugin_class: type[Plugin]) -> None:
        config = self.supported_config(plugin_class.capabilities)
        reasons = plugin_class.validate(config)
        assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons)
        unavailable = plugin_class.unavailable_reason()
        if unavailable:
            assert any(unavailable in reason for reason in reasons), "validate must report why it is unavailable"
        else:
            assert reasons == [], f"validate rejected a config its capabilities declare: {reasons}"

    def test_validate_rejects_what_capabilities_exclude(self, plugin_class: type[Plugin]) -> None:
        for label, config in self.unsupported_configs(plugin_class.capabilities):
            assert plugin_class.validate(config), f"validate accepted a config outside its capabilities ({label})"


def _replace(config: ServingConfig, **changes: Any) -> ServingConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


_REPORT_SCRIPT = r"""
import importlib.metadata as md, json, sys
name = sys.argv[1]
(ep,) = [ep for ep in md.entry_points(group="patchbay") if ep.name == name]
before = set(sys.modules)
error = None
try:
    module = ep.load()
    from patchbay.contract.registry import KINDS
    for kind in KINDS.values():
        hook = getattr(module, kind.hook, None)
        if hook is not None:
            hook(register=lambda *args, **kwargs: None)
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
torch = sys.modules.get("torch")
cuda = bool(torch is not None and torch.cuda.is_initialized())
print(json.dumps({"imported": sorted(set(sys.modules) - before), "hook_module": ep.value.partition(":")[0],
                  "error": error, "cuda_initialized": cuda}))
"""


def _registration_report(plugin: str) -> dict[str, Any]:
    # A fresh interpreter, so modules imported by earlier tests do not hide what registering imports.
    # Run outside the current directory: a source checkout there could shadow the installed distributions.
    result = subprocess.run([sys.executable, "-c", _REPORT_SCRIPT, plugin], capture_output=True, text=True, timeout=120,
                            cwd=tempfile.gettempdir())
    if result.returncode != 0:
        pytest.fail(f"could not inspect plugin {plugin!r}: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
