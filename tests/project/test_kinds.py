"""Every plugin kind is present in each file a kind touches (docs/adding-a-kind.md): a new kind missing from one
of them fails here, naming the file."""

from __future__ import annotations

import ast
import tomllib

import pytest

from patchbay.contract import hookspecs
from patchbay.contract.kinds import KINDS, Kind
from patchbay.contract.settings import PluginChoice, Settings
from patchbay.contract.versions import CONTRACT_VERSIONS

from repo_paths import REPO_ROOT

PLUGINS = REPO_ROOT / "plugins"


def _hooks_implemented() -> dict[str, set[str]]:
    """Built-in plugin folder -> the hooks its ``hooks.py`` implements."""
    found = {}
    for hooks in sorted(PLUGINS.glob("*/hooks.py")):
        tree = ast.parse(hooks.read_text())
        found[hooks.parent.name] = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    return found


HOOKS_BY_FOLDER = _hooks_implemented()


@pytest.fixture(params=list(KINDS.values()), ids=list(KINDS))
def kind(request: pytest.FixtureRequest) -> Kind:
    return request.param


def test_the_interface_is_exported(kind):
    import patchbay.interfaces

    assert kind.interface.__name__ in patchbay.interfaces.__all__, f"core/interfaces/__init__.py: {kind.name}"


def test_the_hook_is_specified(kind):
    spec = getattr(hookspecs, kind.hook, None)
    assert spec is not None and spec.__doc__, f"core/contract/hookspecs.py: no documented {kind.hook}"


def test_the_contract_is_versioned(kind):
    assert kind.name in CONTRACT_VERSIONS, f"core/contract/versions.py: CONTRACT_VERSIONS lacks {kind.name}"


def test_every_choice_site_is_a_name_and_options_in_the_settings(kind):
    for site in kind.choices:
        section, *key = site.path
        assert section in Settings.model_fields, f"core/contract/settings/: no section {section} for {kind.name}"
        model = next(
            arg
            for arg in (
                Settings.model_fields[section].annotation,
                *getattr(Settings.model_fields[section].annotation, "__args__", ()),
            )
            if isinstance(arg, type)
        )
        if key:
            assert key[0] in model.model_fields, f"core/contract/settings/: no key {site.dotted} for {kind.name}"
            assert PluginChoice.__name__ in str(model.model_fields[key[0]].annotation), site.dotted
        else:
            assert {"name", "options"} <= set(model.model_fields), f"{site.dotted} has no name and options"


def test_the_kit_has_a_suite(kind):
    from patchbay.testing import SUITES

    assert kind.name in SUITES, f"core/testing/__init__.py: SUITES lacks {kind.name}"


def test_a_built_in_plugin_folder_registers_it_through_an_entry_point_and_is_tested(kind):
    folders = [folder for folder, hooks in HOOKS_BY_FOLDER.items() if kind.hook in hooks]
    assert folders, f"plugins/: no built-in folder's hooks.py implements {kind.hook}"
    entry_points = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["patchbay"]
    for folder in folders:
        assert f"patchbay.plugins.{folder}.hooks" in entry_points.values(), (
            f"pyproject.toml: no entry point for {folder}"
        )
    from patchbay.testing import SUITES

    suite = SUITES[kind.name].__name__
    tests = [path for path in (REPO_ROOT / "tests" / "plugins").rglob("test_*.py") if suite in path.read_text()]
    assert tests, f"tests/plugins/: no test runs the built-in {kind.name} plugins against {suite}"


def test_the_guide_page_exists_and_names_the_kind(kind):
    page = REPO_ROOT / "docs" / kind.guide
    assert page.is_file(), f"docs/{kind.guide} (the guide of {kind.name}) does not exist"
    assert kind.name in page.read_text(), f"docs/{kind.guide} never names the kind {kind.name}"


def test_the_page_on_adding_a_kind_lists_every_step_this_test_checks():
    text = (REPO_ROOT / "docs" / "adding-a-kind.md").read_text()
    for path in (
        "core/interfaces/__init__.py",
        "core/contract/hookspecs.py",
        "core/contract/kinds.py",
        "core/contract/versions.py",
        "core/contract/settings/",
        "core/testing/__init__.py",
        "pyproject.toml",
        "tests/plugins/",
        "docs/plugin-kinds/",
    ):
        assert path in text, f"docs/adding-a-kind.md does not name {path}"
