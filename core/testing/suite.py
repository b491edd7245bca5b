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

A test skips for one of two kinds of reason.  :func:`skip_not_declared`
skips what the plugin's capabilities say it does not do (a greedy-only
sampler's random-sampling checks) or what does not apply to it; every other
skip (the plugin is unavailable here, a store is unreachable, a test context
cannot be built) means a behaviour went unchecked, and strict mode
(``pytest --patchbay-strict``, ``patchbay check --strict``) fails it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, ClassVar, Generic, TypeVar, cast

import pytest
from pydantic import BaseModel, ValidationError

from patchbay.contract.registry import KINDS, Registration, Registry
from patchbay.interfaces import Capabilities, Plugin, ServingConfig


# mypy cannot read pytest.skip.Exception (an attribute pytest sets on the skip function) as a class.
class NotDeclared(pytest.skip.Exception):  # type: ignore[name-defined]
    """A skip strict mode accepts: the plugin declares it does not do this, or the test does not apply to it."""


# pytest prints a skip's reason as "<qualified exception name>: <reason>" unless the exception is its own; a
# short name keeps the summary line readable ("NotDeclared: greedy only") rather than the module path.
NotDeclared.__module__ = "builtins"


def skip_not_declared(reason: str) -> None:
    """Skip the current test because the plugin declares it does not do what the test checks."""
    raise NotDeclared(msg=reason, pytrace=False)


CapabilitiesT = TypeVar("CapabilitiesT", bound=Capabilities)
"""The capabilities class of the kind a suite checks."""


def options_env(kind: str) -> str:
    """The environment variable holding the options (a JSON object) the kit tests ``kind``'s plugins with:
    ``PATCHBAY_TEST_<KIND>_OPTIONS``, e.g. ``PATCHBAY_TEST_TOOL_PARSER_OPTIONS``."""
    return f"PATCHBAY_TEST_{kind.upper()}_OPTIONS"


class PluginSuite(Generic[CapabilitiesT]):
    """Checks every plugin must pass, whatever its kind: registration hygiene, options, capabilities."""

    kind: ClassVar[str] = ""
    """The kind under test; set by each kind's suite."""
    plugin_name: ClassVar[str | None] = None
    """The registered name of the implementation under test."""
    known_gaps: ClassVar[dict[str, str]] = {}
    """Test name -> reason, for tests this implementation is known to fail."""
    capabilities_class: ClassVar[type[Capabilities]] = Capabilities
    plugin_options: ClassVar[dict[str, Any] | None] = None
    """Options the plugin is tested with; unset, those in ``PATCHBAY_TEST_<KIND>_OPTIONS`` (JSON), else each
    suite's default (``patchbay check --options JSON`` sets this)."""
    takes_options: ClassVar[bool] = True
    """Whether the suite builds the plugin with :meth:`given_options` (the attention suites use the defaults)."""

    def given_options(self) -> dict[str, Any] | None:
        """The options a run fixes: :attr:`plugin_options`, else the kind's ``PATCHBAY_TEST_<KIND>_OPTIONS``,
        else ``None`` (the suite's default)."""
        if self.plugin_options:
            return dict(self.plugin_options)
        variable = options_env(self.kind)
        raw = os.environ.get(variable)
        if not raw:
            return None
        try:
            options = json.loads(raw)
        except json.JSONDecodeError as exc:
            pytest.fail(f"{variable} is not JSON ({exc}): {raw!r}")
        if not isinstance(options, dict):
            pytest.fail(f"{variable} must hold a JSON object of options, got {raw!r}")
        return options

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
            pytest.skip(f"unavailable: {reason}")  # not a declared limit: strict mode fails it
        return plugin_class

    # -- what each kind's suite supplies -----------------------------------------------------

    def supported_config(self, capabilities: CapabilitiesT) -> ServingConfig:
        """A configuration inside ``capabilities`` (each kind's suite overrides)."""
        return ServingConfig(device=capabilities.devices[0], dtype=capabilities.dtypes[0])

    def unsupported_configs(self, capabilities: CapabilitiesT) -> list[tuple[str, ServingConfig]]:
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
        """Loading the plugin's hooks module and running its hooks imports no torch nor implementation, writes no file.

        Checked in a fresh interpreter for every registration, a lazy
        ``"module:Class"`` string or a class alike.
        """
        if not self.plugin_name:
            skip_not_declared("the plugin class was supplied directly; there is no registration to inspect")
        registration: Registration = request.getfixturevalue("registration")
        if registration.origin.distribution == "<local>":
            skip_not_declared(
                "the plugin was added to the registry by hand; only installed distributions are loaded "
                "the way patchbay loads them"
            )
        report = _registration_report(registration.origin.plugin)
        assert report["error"] is None, f"registering plugin {registration.origin.plugin!r} failed: {report['error']}"
        problems = registration_problems(registration, report)
        assert not problems, f"registering {registration.reference} ({registration.origin}): " + "; ".join(problems)

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

    def declared_capabilities(self, plugin_class: type[Plugin]) -> CapabilitiesT:
        """The plugin's capabilities, asserted to be an instance of its kind's :attr:`capabilities_class`."""
        capabilities = plugin_class.capabilities
        assert isinstance(capabilities, self.capabilities_class), (
            f"capabilities must be a {self.capabilities_class.__name__}, got {type(capabilities).__name__}"
        )
        return cast(CapabilitiesT, capabilities)

    def test_capabilities_are_declared(self, plugin_class: type[Plugin]) -> None:
        capabilities = self.declared_capabilities(plugin_class)
        assert capabilities.devices, "declare at least one device"
        assert capabilities.dtypes, "declare at least one dtype"
        json.dumps(capabilities.as_dict())

    def test_unavailable_reason_is_text_or_none(self, plugin_class: type[Plugin]) -> None:
        reason = plugin_class.unavailable_reason()
        assert reason is None or (isinstance(reason, str) and reason.strip())

    def test_validate_accepts_a_supported_config(self, plugin_class: type[Plugin]) -> None:
        config = self.supported_config(self.declared_capabilities(plugin_class))
        reasons = plugin_class.validate(config)
        assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons)
        unavailable = plugin_class.unavailable_reason()
        if unavailable:
            assert any(unavailable in reason for reason in reasons), "validate must report why it is unavailable"
        else:
            assert reasons == [], f"validate rejected a config its capabilities declare: {reasons}"

    def test_validate_rejects_what_capabilities_exclude(self, plugin_class: type[Plugin]) -> None:
        for label, config in self.unsupported_configs(self.declared_capabilities(plugin_class)):
            assert plugin_class.validate(config), f"validate accepted a config outside its capabilities ({label})"


def _replace(config: ServingConfig, **changes: Any) -> ServingConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


def registration_problems(registration: Registration, report: dict[str, Any]) -> list[str]:
    """What is wrong with what loading a plugin's hooks module did (``report`` of :func:`_registration_report`)."""
    problems = []
    hook_module = report["hook_module"]
    target_module = registration.target_path.partition(":")[0]
    if target_module != hook_module and target_module in report["imported"]:
        how = "a class" if not isinstance(registration.target, str) else "a string, but its hooks module imports it"
        problems.append(
            f"it imported the implementation module {target_module} (registered as {how}); register a "
            "'module:Class' string and keep heavy imports out of the hooks module"
        )
    heavy = sorted(module for module in report["imported"] if module.partition(".")[0] in HEAVY_MODULES)
    if heavy:
        problems.append(
            f"it imported {', '.join(sorted({m.partition('.')[0] for m in heavy}))} "
            f"({len(heavy)} modules); import heavy libraries in the implementation module only"
        )
    if report["written"]:
        problems.append(f"it wrote files: {', '.join(report['written'][:5])}; registration must have no side effects")
    if report["cuda_initialized"]:
        problems.append("it initialised CUDA")
    return problems


HEAVY_MODULES = frozenset({"torch", "transformers", "numpy", "triton", "jax", "tensorflow"})
"""Libraries a hooks module must not import: listing plugins would pay for them (and may touch a device)."""


_REPORT_SCRIPT = r"""
import importlib.metadata as md, json, os, sys
name = sys.argv[1]
(ep,) = [ep for ep in md.entry_points(group="patchbay") if ep.name == name]
import patchbay  # the package itself is not the plugin's doing
written = []
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _audit(event, args):
    if event == "open" and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (mode is None and flags & _WRITE_FLAGS):
            written.append(os.fsdecode(args[0]))
    elif event in ("os.mkdir", "os.remove", "os.rename", "os.rmdir", "os.truncate", "shutil.rmtree"):
        written.append(os.fsdecode(args[0]) if not isinstance(args[0], int) else str(args[0]))

before = set(sys.modules)
error = None
sys.addaudithook(_audit)
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
written = sorted(set(path for path in written if not path.endswith((".pyc", ".pyc.tmp")) and "__pycache__" not in path))
print(json.dumps({"imported": sorted(set(sys.modules) - before), "hook_module": ep.value.partition(":")[0],
                  "error": error, "cuda_initialized": cuda, "written": written}))
"""


def _registration_report(plugin: str) -> dict[str, Any]:
    # A fresh interpreter, so modules imported by earlier tests do not hide what registering imports.
    # Run outside the current directory: a source checkout there could shadow the installed distributions.
    result = subprocess.run(
        [sys.executable, "-c", _REPORT_SCRIPT, plugin],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tempfile.gettempdir(),
    )
    if result.returncode != 0:
        pytest.fail(f"could not inspect plugin {plugin!r}: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
