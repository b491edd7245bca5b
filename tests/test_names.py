"""One name per concept: plugin folders are named after their kinds, counts of kinds follow the registry,
and every renamed public name still works, with a warning, as docs/plugin-guide.md's "Deprecated names" says."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from patchbay.contract.registry import KINDS
from patchbay.contract.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent
NUMBER_WORDS = {
    word: value
    for value, word in enumerate(
        ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    )
}


def test_every_plugin_folder_is_named_after_the_kind_it_holds():
    names = {kind for name in KINDS for kind in (name, f"{name}s")}
    folders = [path.name for path in (REPO_ROOT / "plugins").iterdir() if (path / "__init__.py").exists()]
    assert folders and not [folder for folder in folders if folder not in names], (
        f"plugin folders not named after a kind ({', '.join(KINDS)}, or their plurals): {sorted(folders)}"
    )


def test_every_kind_has_a_conformance_suite():
    from patchbay.testing import SUITES

    assert set(SUITES) == set(KINDS)


def _sources() -> list[Path]:
    return [
        REPO_ROOT / "README.md",
        *(REPO_ROOT / "docs").glob("*.md"),
        *(REPO_ROOT / "core").rglob("*.py"),
        *(REPO_ROOT / "plugins").rglob("*.py"),
    ]


def test_texts_that_count_the_kinds_count_the_registry_s():
    wrong = []
    for path in _sources():
        for match in re.finditer(r"\b(\w+) (?:plugin kinds|kinds\b(?! of))", path.read_text(), re.IGNORECASE):
            count = NUMBER_WORDS.get(match.group(1).lower(), int(match.group(1)) if match.group(1).isdigit() else None)
            if count is not None and count != len(KINDS):
                wrong.append(f"{path.relative_to(REPO_ROOT)}: {match.group(0)!r}")
    assert not wrong, f"there are {len(KINDS)} kinds: " + ", ".join(wrong)


def test_the_old_drafters_package_imports_as_the_same_modules_with_a_warning():
    import patchbay.plugins.drafters.eagle as eagle

    for name in [name for name in sys.modules if name.startswith("patchbay.plugins.spec_decode")]:
        del sys.modules[name]  # only the aliases: the modules stay under their own names
    with pytest.warns(DeprecationWarning, match="patchbay.plugins.spec_decode.eagle is deprecated"):
        old = importlib.import_module("patchbay.plugins.spec_decode.eagle")
    assert old is eagle and old.EagleDrafter is eagle.EagleDrafter
    assert eagle.__spec__.name == "patchbay.plugins.drafters.eagle"
    with pytest.raises(ModuleNotFoundError, match="patchbay.plugins.drafters.no_such_module"):
        importlib.import_module("patchbay.plugins.spec_decode.no_such_module")


def test_the_old_engine_module_and_rank_names_still_import_with_a_warning():
    import patchbay.engine
    import patchbay.engine.ranks

    with pytest.warns(DeprecationWarning, match="patchbay.engine.core is deprecated"):
        old = importlib.reload(importlib.import_module("patchbay.engine.core"))
    assert old.Engine is patchbay.engine.Engine
    assert old.measure_machine_defaults is patchbay.engine.measure_machine_defaults
    with pytest.warns(DeprecationWarning, match="ParallelRanks"):
        assert patchbay.engine.ranks.TensorParallelRanks is patchbay.engine.ranks.ParallelRanks


def test_the_old_entry_point_name_in_the_plugin_policy_means_the_new_one():
    with pytest.warns(FutureWarning, match="'spec_decode' is now called 'drafters'"):
        settings = Settings.model_validate({"plugins": {"deny": "spec_decode,other", "allow": ["spec_decode"]}})
    assert settings.plugins.deny == ["drafters", "other"] and settings.plugins.allow == ["drafters"]
