"""One name per concept: plugin folders are named after their kinds, and counts of kinds follow the registry."""

from __future__ import annotations

import re
from pathlib import Path


from patchbay.contract.registry import KINDS

from repo_paths import REPO_ROOT

NUMBER_WORDS = {
    word: value
    for value, word in enumerate(
        ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    )
}


def test_every_plugin_folder_is_named_after_the_kind_it_holds():
    # A kind's name, its plural, or the settings section that chooses it (spec_decode: the drafters).
    sections = {site.path[0] for kind in KINDS.values() for site in kind.choices if len(site.path) == 1}
    names = {kind for name in KINDS for kind in (name, f"{name}s")} | sections
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
