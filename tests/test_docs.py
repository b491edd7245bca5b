"""The documentation stays true to the code.

- docs/reference.md is exactly what docs/generate_reference.py makes of the code;
- every relative link in README.md and docs/*.md reaches an existing file (and heading);
- every ``patchbay SUBCOMMAND`` the docs show exists in the CLI parser;
- every ```yaml block of the configuration guide and the plugin guide is a valid settings file,
  and every request example is a valid request;
- every settings key, sampling parameter and result field has a row in docs/configuration.md;
- the plugin guide's worked example, written out file by file, installs and passes the kit.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from patchbay.contract.settings import Section, Settings, load_settings
from patchbay.engine.outputs import RequestMetrics, RequestOutput
from patchbay.entrypoints.cli import build_parser
from patchbay.entrypoints.run_command import read_requests
from patchbay.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs"
DOC_FILES = sorted([REPO_ROOT / "README.md", *DOCS.glob("*.md")])
CONFIGURATION = DOCS / "configuration.md"
PLUGIN_GUIDE = DOCS / "plugin-guide.md"

# docs/benchmarks.md is written by the lead alongside the benchmark harness; until it lands, links to it
# are the one exception to "every relative link reaches an existing file".
LINK_TARGETS_NOT_YET_WRITTEN = {DOCS / "benchmarks.md"}

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(info string, body)`` of every fenced code block."""
    return [(match.group(1).strip(), match.group(2)) for match in FENCE.finditer(text)]


def prose(text: str) -> str:
    """``text`` without fenced code blocks."""
    return FENCE.sub("", text)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text (duplicates get -1, -2, ...)."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for _, title in HEADING.findall(prose(text)):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        count = counts.get(slug, 0)
        counts[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def doc_id(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


# -- the reference is generated -----------------------------------------------------------------------


def test_the_reference_is_what_the_generator_makes_of_the_code():
    result = subprocess.run([sys.executable, str(DOCS / "generate_reference.py"), "--check"],
                            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, (
        "docs/reference.md is stale; regenerate it with: python docs/generate_reference.py\n"
        + result.stdout[-4000:] + result.stderr[-2000:]
    )


# -- links ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOC_FILES, ids=doc_id)
def test_every_relative_link_reaches_an_existing_file_and_heading(doc: Path):
    text = doc.read_text()
    broken = []
    for target in LINK.findall(INLINE_CODE.sub("``", prose(text))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        linked = (doc.parent / path_part).resolve() if path_part else doc
        if linked in LINK_TARGETS_NOT_YET_WRITTEN and not linked.exists():
            continue
        if not linked.exists():
            broken.append(f"{target}: no such file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor} in {doc_id(linked)}")
    assert not broken, f"{doc_id(doc)} has broken links:\n  " + "\n  ".join(broken)


# -- commands -------------------------------------------------------------------------------------------


def cli_commands() -> dict[str, set[str]]:
    """Each subcommand of ``patchbay`` with the names of its own subcommands (empty if it has none)."""

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    return {name: set(subcommands(sub)) for name, sub in subcommands(build_parser()).items()}


COMMAND = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:\S*/)?patchbay\s+(\S+)(?:\s+(\S+))?")


def documented_commands(text: str) -> set[tuple[str, str | None]]:
    """``(subcommand, next word)`` of every ``patchbay ...`` command line the text shows.

    Command lines are the lines of sh/bash/console blocks, lines after a ``$ `` prompt in
    any block, and inline code that starts with the command (``.venv/bin/patchbay run``).
    Environment assignments before the command are skipped.
    """
    lines: list[str] = []
    for info, body in fenced_blocks(text):
        language = info.split()[0] if info else ""
        for line in body.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                lines.append(line[2:])
            elif language in ("sh", "bash", "shell", "console"):
                lines.append(re.sub(r"\s+#.*$", "", line))  # drop a trailing shell comment
    lines += [span.strip("`") for span in INLINE_CODE.findall(prose(text))]
    found = set()
    for line in lines:
        match = COMMAND.match(line)
        if match:
            found.add((match.group(1), match.group(2)))
    return found


@pytest.mark.parametrize("doc", DOC_FILES, ids=doc_id)
def test_every_patchbay_command_shown_exists(doc: Path):
    commands = cli_commands()
    wrong = []
    for command, argument in sorted(documented_commands(doc.read_text()), key=str):
        if command.startswith("-"):
            continue  # `patchbay --help`
        if command not in commands:
            wrong.append(f"patchbay {command}: no such subcommand (the CLI has {', '.join(sorted(commands))})")
        elif commands[command] and argument is not None and not argument.startswith(("-", "<")) \
                and argument not in commands[command] and argument.isidentifier():
            wrong.append(f"patchbay {command} {argument}: no such subcommand "
                         f"(`patchbay {command}` has {', '.join(sorted(commands[command]))})")
    assert not wrong, f"{doc_id(doc)} shows commands the CLI does not have:\n  " + "\n  ".join(wrong)


def test_the_command_scan_finds_the_commands_of_the_readme():
    found = documented_commands((REPO_ROOT / "README.md").read_text())
    assert ("config", "validate") in found and ("plugins", None) in found and ("run", "examples/quickstart.yaml") in found


# -- examples of the configuration guide -----------------------------------------------------------------


def blocks_of(doc: Path, language: str) -> list[str]:
    return [body for info, body in fenced_blocks(doc.read_text()) if info.split()[:1] == [language]]


@pytest.fixture
def no_patchbay_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [key for key in os.environ if key.startswith("PATCHBAY_")]:
        monkeypatch.delenv(key)


YAML_EXAMPLES = [(doc, index, body) for doc in (CONFIGURATION, PLUGIN_GUIDE)
                 for index, body in enumerate(blocks_of(doc, "yaml"))]


@pytest.mark.parametrize(("doc", "index", "body"), YAML_EXAMPLES,
                         ids=[f"{doc.name}-yaml{index}" for doc, index, _ in YAML_EXAMPLES])
def test_every_yaml_example_is_a_valid_settings_file(doc: Path, index: int, body: str, tmp_path: Path,
                                                     no_patchbay_env: None):
    path = tmp_path / f"{doc.stem}-{index}.yaml"
    path.write_text(body)
    settings = load_settings(path)
    if settings.inputs.prompts and settings.inputs.file is None:
        read_requests(settings, str(path))  # its requests and sampling parameters are valid too


def test_the_configuration_guide_has_yaml_examples():
    assert len(blocks_of(CONFIGURATION, "yaml")) >= 3


@pytest.mark.parametrize("index", range(len(blocks_of(CONFIGURATION, "jsonl"))))
def test_every_jsonl_request_example_is_valid(index: int, tmp_path: Path, no_patchbay_env: None):
    (tmp_path / "requests.jsonl").write_text(blocks_of(CONFIGURATION, "jsonl")[index])
    (tmp_path / "job.yaml").write_text("inputs:\n  file: requests.jsonl\n")
    settings = load_settings(tmp_path / "job.yaml")
    assert read_requests(settings, str(tmp_path / "job.yaml"))


def table_keys(text: str, heading: str) -> set[str]:
    """The first-column `names` of the table rows under ``heading`` (up to the next heading)."""
    start = text.index(heading + "\n")
    end = min((m.start() for m in HEADING.finditer(text, start + len(heading))), default=len(text))
    return set(re.findall(r"^\| `([^`]+)` \|", text[start:end], re.MULTILINE))


def test_every_settings_key_has_a_row_in_the_configuration_guide():
    text = CONFIGURATION.read_text()
    missing = []
    for section, field in Settings.model_fields.items():
        model = next(arg for arg in (field.annotation, *getattr(field.annotation, "__args__", ()))
                     if isinstance(arg, type) and issubclass(arg, Section))
        documented = table_keys(text, f"### `{section}`")
        missing += [f"{section}.{key}" for key in model.model_fields if key not in documented]
    assert not missing, f"docs/configuration.md has no row for: {', '.join(missing)}"


def test_every_sampling_parameter_and_result_field_has_a_row_in_the_configuration_guide():
    text = CONFIGURATION.read_text()
    parameters = table_keys(text, "### Sampling parameters")
    assert set(SamplingParams.model_fields) <= parameters, set(SamplingParams.model_fields) - parameters
    output = RequestOutput("r", "p", [1], SamplingParams(), logprobs=[], metrics=RequestMetrics(0.0))
    fields = table_keys(text, "## Results")
    assert set(output.as_dict()) <= fields, set(output.as_dict()) - fields
    for metric in output.metrics.as_dict():
        assert f"`{metric}`" in text, f"metric {metric} is not described"


# -- the plugin guide's worked example -------------------------------------------------------------------


GUIDE_FILE = re.compile(r"^<!-- file: (\S+) -->\n```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def guide_files() -> dict[str, str]:
    """The files of the worked example, by path: every code block preceded by ``<!-- file: PATH -->``."""
    return dict(GUIDE_FILE.findall(PLUGIN_GUIDE.read_text()))


def test_the_worked_example_installs_lists_and_passes_the_kit(tmp_path: Path):
    files = guide_files()
    assert "patchbay-temperature/pyproject.toml" in files and len(files) >= 5, sorted(files)
    for relative, body in files.items():
        path = tmp_path / "src" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    site = tmp_path / "site"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PATCHBAY_") and key != "PYTHONPATH"}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    # Install from a copy, as a user would; offline, and never into the venv.
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(tmp_path / "src" / "patchbay-temperature")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    env["PYTHONPATH"] = str(site)

    listing = subprocess.run([sys.executable, "-m", "patchbay.entrypoints.cli", "plugins", "--kind", "sampler"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert listing.returncode == 0, listing.stderr
    assert re.search(r"temperature\s+patchbay-temperature 0\.1\.0\s+\[available\]", listing.stdout), listing.stdout

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                           capture_output=True, text=True, env=env, timeout=300,
                           cwd=tmp_path / "src" / "patchbay-temperature")
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert "passed" in tests.stdout and "failed" not in tests.stdout

    check = subprocess.run([sys.executable, "-m", "patchbay.entrypoints.cli", "check", "sampler:temperature"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-2000:]
