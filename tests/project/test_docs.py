"""The documentation stays true to the code.

- docs/reference.md, the key tables of docs/configuration.md and the room table of
  docs/architecture.md are exactly what docs/generate_reference.py makes of the code;
- every relative link in README.md and docs/**/*.md reaches an existing file (and heading);
- no table cell runs past 60 words, the architecture overview stays under 15 KB, every path its
  feature table names exists, and docs/benchmarks.md opens with one stamped table;
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
import textwrap
from itertools import pairwise
from pathlib import Path

import pytest

from patchbay.contract.settings import Section, Settings, load_settings
from patchbay.engine.outputs import RequestMetrics, RequestOutput
from patchbay.entrypoints.cli import build_parser
from patchbay.entrypoints.run_command import read_requests
from patchbay.sampling_params import SamplingParams

from doc_text import CONFIGURATION, DOCS, FENCE, fenced_blocks, shell_lines
from repo_paths import REPO_ROOT

DOC_FILES = sorted([REPO_ROOT / "README.md", *DOCS.rglob("*.md")])
PLUGIN_GUIDE = DOCS / "plugin-guide.md"
ARCHITECTURE = DOCS / "architecture.md"
BENCHMARKS = DOCS / "benchmarks.md"

INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


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


def test_the_generated_pages_are_what_the_generator_makes_of_the_code():
    result = subprocess.run(
        [sys.executable, str(DOCS / "generate_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, (
        "a generated page is stale; regenerate it with: python docs/generate_reference.py\n"
        + result.stdout[-4000:]
        + result.stderr[-2000:]
    )


@pytest.fixture
def docs_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/'s generator modules importable (they are scripts' siblings, not a package)."""
    monkeypatch.syspath_prepend(str(DOCS))


def test_a_settings_key_without_a_docstring_stops_the_generator(docs_generators: None):
    from pydantic import BaseModel
    from settings_tables import UndocumentedKey, rows

    class Documented(BaseModel):
        size: int = 1
        """How big."""
        colour: str = "red"

    with pytest.raises(UndocumentedKey, match="Documented.colour has no docstring"):
        rows(Documented, CONFIGURATION, lambda name: [f"`{name}`"])


def test_a_validator_that_widens_the_values_must_say_what_it_accepts(docs_generators: None):
    from typing import Annotated

    from pydantic import BaseModel, BeforeValidator
    from settings_tables import UndocumentedKey, rows

    def _anything_goes(value: object) -> object:
        return value

    class Widened(BaseModel):
        size: Annotated[int, BeforeValidator(_anything_goes)] = 1
        """How big."""

    with pytest.raises(UndocumentedKey, match="'_anything_goes'"):
        rows(Widened, CONFIGURATION, lambda name: [f"`{name}`"])


def test_the_generated_rows_say_values_default_and_link_design_pages(docs_generators: None):
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field, PositiveInt
    from settings_tables import rows

    class Example(BaseModel):
        count: PositiveInt | None = None
        """How many (docs/design/kv-cache.md#sizing-the-pool)."""
        mode: Literal["auto", "fast"] = "auto"
        """Which | way."""
        port: Annotated[int, Field(ge=1, le=65535)] = 80
        """A port."""

    assert rows(Example, CONFIGURATION, lambda name: [f"`{name}`"]) == [
        "| `count` | positive integer or null | `null` | How many "
        "([sizing the pool](design/kv-cache.md#sizing-the-pool)). |",
        "| `mode` | `auto`, `fast` | `auto` | Which \\| way. |",
        "| `port` | integer 1–65535 | `80` | A port. |",
    ]


def test_a_marked_block_nothing_generates_or_a_missing_marker_stops_the_generator(docs_generators: None):
    from generate_reference import fill_marked_blocks

    page = DOCS / "page.md"
    text = "intro\n<!-- generated: a -->\nold\n<!-- end generated: a -->\noutro\n"
    assert fill_marked_blocks(text, {"a": "new\n"}, page) == text.replace("old", "new")
    with pytest.raises(SystemExit, match="no markers for b"):
        fill_marked_blocks(text, {"a": "new\n", "b": "x\n"}, page)
    with pytest.raises(SystemExit, match="marks a block 'a' that nothing generates"):
        fill_marked_blocks(text, {}, page)


# -- readable length ------------------------------------------------------------------------------------

CELL_WORD_LIMIT = 60
TABLE_ROW = re.compile(r"^\|(.*)\|\s*$", re.MULTILINE)


def table_cells(text: str) -> list[str]:
    """Every cell of every Markdown table of ``text`` (fenced blocks left out)."""
    cells = []
    for row in TABLE_ROW.findall(prose(text)):
        cells += [cell.strip() for cell in re.split(r"(?<!\\)\|", row) if not re.fullmatch(r"\s*:?-+:?\s*", cell)]
    return cells


@pytest.mark.parametrize("doc", DOC_FILES, ids=doc_id)
def test_no_table_cell_runs_past_sixty_words(doc: Path):
    long = [
        f"{len(cell.split())} words: {cell[:80]}..."
        for cell in table_cells(doc.read_text())
        if len(cell.split()) > CELL_WORD_LIMIT
    ]
    assert not long, (
        f"{doc_id(doc)} has table cells over {CELL_WORD_LIMIT} words (generated rows come from field "
        "docstrings; move the long explanation to docs/design/ and link it):\n  " + "\n  ".join(long)
    )


def test_the_cell_check_counts_words_per_cell():
    assert table_cells("| a | b c |\n|---|---|\n| `x \\| y` | z |\n") == ["a", "b c", "`x \\| y`", "z"]


def test_the_architecture_overview_reads_in_ten_minutes():
    # 15.5 KB: the generated rooms table grows with every room's modules (the architecture kind added ~450 bytes).
    assert len(ARCHITECTURE.read_bytes()) < 15_500, "docs/architecture.md is over 15.5 KB: move detail to docs/design/"


def feature_paths(text: str) -> list[str]:
    """The repository paths (``core/...``, ``plugins/...``) the feature table of the overview names."""
    start = text.index("## Where is ...?")
    end = text.index("\n## ", start + 1)
    return re.findall(r"`((?:core|plugins|tests|docs|examples)/[^`]*)`", text[start:end])


def test_every_path_the_feature_table_names_exists():
    paths = feature_paths(ARCHITECTURE.read_text())
    assert len(paths) >= 10, paths
    missing = [path for path in paths if not (REPO_ROOT / path).exists()]
    assert not missing, f"docs/architecture.md's feature table names paths that do not exist: {missing}"


def test_the_feature_table_answers_where_each_feature_lives():
    text = ARCHITECTURE.read_text()
    table = text[text.index("## Where is ...?") :]
    for feature in (
        "structured output",
        "speculative decoding",
        "tensor and pipeline parallelism",
        "KV connectors",
        "LoRA adapters",
        "multimodal (images)",
        "tool calling, reasoning output",
    ):
        assert re.search(rf"^\| {re.escape(feature)} \|", table, re.MULTILINE), feature


def test_the_benchmarks_open_with_one_stamped_table_per_cpu_kind():
    """One current table per CPU kind seen (issue 55): the like-for-like precision first, stamped where it has
    figures, and saying so where none were measured yet."""
    text = BENCHMARKS.read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    assert sections[1].startswith("Current figures"), "docs/benchmarks.md's first section must be the current figures"
    kinds = {
        part.splitlines()[0]: part
        for part in re.split(r"^### ", sections[1], flags=re.MULTILINE)[1:]
        if not part.startswith("The commands")
    }
    assert list(kinds) == ["Intel Xeon with AMX", "AMD EPYC with AVX512-BF16, no AMX", "AVX2 only"]
    for name, part in kinds.items():
        header = next(line for line in part.splitlines() if line.startswith("| "))
        assert re.match(r"\| workload \| patchbay (bf16|f32) \| vLLM (bf16|f32) \|", header), f"{name}: {header}"
        rows = [line.strip("|").split("|") for line in part.splitlines() if line.startswith("| ")]
        figures = [
            cells
            for cells in rows
            if cells[0].strip() not in ("engine", "workload") and any(re.match(r"\s*\d", cell) for cell in cells[1:])
        ]
        if figures:
            assert re.search(r"\b20\d\d-\d\d-\d\d\b", part), f"{name}: the table has no date"
            assert re.search(r"commit [0-9a-f]{7,}", part), f"{name}: the table has no commit"
        else:
            assert re.search(r"Not yet measured|has been at hand", part), f"{name}: an empty table says why"
    assert not re.search(r"^## .*\brun\b", text, re.MULTILINE | re.IGNORECASE), "run logs go to docs/design/"


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


def documented_command_lines(text: str) -> list[str]:
    """Every ``patchbay ...`` command line the text shows.

    Command lines are the :func:`shell_lines` and inline code that starts with the command
    (``.venv/bin/patchbay run``). Environment assignments before the command are skipped.
    """
    lines = shell_lines(text) + [span.strip("`") for span in INLINE_CODE.findall(prose(text))]
    return [line for line in lines if COMMAND.match(line)]


def documented_commands(text: str) -> set[tuple[str, str | None]]:
    """``(subcommand, next word)`` of every ``patchbay ...`` command line the text shows."""
    return {
        (match.group(1), match.group(2)) for line in documented_command_lines(text) if (match := COMMAND.match(line))
    }


@pytest.mark.parametrize("doc", DOC_FILES, ids=doc_id)
def test_every_patchbay_command_shown_exists(doc: Path):
    commands = cli_commands()
    wrong = []
    for command, argument in sorted(documented_commands(doc.read_text()), key=str):
        if command.startswith("-"):
            continue  # `patchbay --help`
        if command not in commands:
            wrong.append(f"patchbay {command}: no such subcommand (the CLI has {', '.join(sorted(commands))})")
        elif (
            commands[command]
            and argument is not None
            and not argument.startswith(("-", "<"))
            and argument not in commands[command]
            and argument.isidentifier()
        ):
            wrong.append(
                f"patchbay {command} {argument}: no such subcommand "
                f"(`patchbay {command}` has {', '.join(sorted(commands[command]))})"
            )
    assert not wrong, f"{doc_id(doc)} shows commands the CLI does not have:\n  " + "\n  ".join(wrong)


def test_the_command_scan_finds_the_commands_of_the_readme():
    found = documented_commands((REPO_ROOT / "README.md").read_text())
    assert (
        ("config", "validate") in found and ("plugins", None) in found and ("run", "examples/quickstart.yaml") in found
    )


# -- examples of the configuration guide -----------------------------------------------------------------


def blocks_of(doc: Path, language: str) -> list[str]:
    return [body for info, body in fenced_blocks(doc.read_text()) if info.split()[:1] == [language]]


@pytest.fixture
def no_patchbay_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [key for key in os.environ if key.startswith("PATCHBAY_")]:
        monkeypatch.delenv(key)


YAML_EXAMPLES = [
    (doc, index, body) for doc in (CONFIGURATION, PLUGIN_GUIDE) for index, body in enumerate(blocks_of(doc, "yaml"))
]


@pytest.mark.parametrize(
    ("doc", "index", "body"), YAML_EXAMPLES, ids=[f"{doc.name}-yaml{index}" for doc, index, _ in YAML_EXAMPLES]
)
def test_every_yaml_example_is_a_valid_settings_file(
    doc: Path, index: int, body: str, tmp_path: Path, no_patchbay_env: None
):
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
        model = next(
            arg
            for arg in (field.annotation, *getattr(field.annotation, "__args__", ()))
            if isinstance(arg, type) and issubclass(arg, Section)
        )
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
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(tmp_path / "src" / "patchbay-temperature"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    env["PYTHONPATH"] = str(site)

    listing = subprocess.run(
        [sys.executable, "-m", "patchbay.entrypoints.cli", "plugins", "--kind", "sampler"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert listing.returncode == 0, listing.stderr
    assert re.search(r"temperature\s+patchbay-temperature 0\.1\.0\s+contract 1\.1\s+\[available\]", listing.stdout), (
        listing.stdout
    )

    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path / "src" / "patchbay-temperature",
    )
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert "passed" in tests.stdout and "failed" not in tests.stdout

    check = subprocess.run(
        [sys.executable, "-m", "patchbay.entrypoints.cli", "check", "--strict", "sampler:temperature"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-2000:]
    # The guide's sample output is this run's: the same tests, in the same order, with the same outcomes.
    assert check_outcomes(check.stdout) == check_outcomes(guide_check_sample()), (
        "the guide's patchbay check sample is stale"
    )


def check_outcomes(text: str) -> list[tuple[str, str]]:
    """``(test, outcome)`` of each per-test line of a ``patchbay check`` output, in order."""
    return re.findall(r"::TestConformance::(\S+) (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)", text)


def guide_check_sample() -> str:
    (sample,) = [
        body
        for _, body in fenced_blocks(PLUGIN_GUIDE.read_text())
        if body.startswith("$ patchbay check --strict sampler:temperature")
    ]
    return sample


STRUCTURED_OUTPUT_PAGE = DOCS / "plugin-kinds" / "structured-output.md"
EXAMPLE_MARK = "<!-- example: structured-output backend -->"


def structured_output_example() -> str:
    """The code block that follows the example mark on the structured-output page."""
    text = STRUCTURED_OUTPUT_PAGE.read_text()
    assert EXAMPLE_MARK in text, f"{STRUCTURED_OUTPUT_PAGE.name} lost its example"
    info, body = fenced_blocks(text[text.index(EXAMPLE_MARK) :])[0]
    assert info == "python"
    return body


def test_the_structured_output_example_is_the_example_plugins_backend():
    source = REPO_ROOT / "tests" / "distributions" / "example_plugin" / "patchbay_example" / "structured_output.py"
    assert structured_output_example() == source.read_text(), f"the page's example differs from {source}"


def test_the_structured_output_example_runs_and_passes_the_kit(tmp_path):
    """The page's code, executed as written: a module, registered by hand, through the whole structured-output kit."""
    (tmp_path / "guide_choice.py").write_text(structured_output_example())
    (tmp_path / "test_guide_choice.py").write_text(
        textwrap.dedent("""
            import pytest

            from patchbay import hookimpl
            from patchbay.contract.registry import Registry
            from patchbay.testing import StructuredOutputSuite


            class Hooks:
                @hookimpl
                def register_structured_output_backends(self, register):
                    register("guide_choice", "guide_choice:ExampleChoiceBackend")


            class TestGuideChoice(StructuredOutputSuite):
                plugin_name = "guide_choice"

                @pytest.fixture
                def patchbay_registry(self):
                    registry = Registry()
                    registry.add_plugin(Hooks(), name="guide")
                    return registry
            """)
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--patchbay-strict", "-rs", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\b(2\d|1\d) passed", result.stdout), result.stdout[-2000:]
    assert "failed" not in result.stdout


ARCHITECTURE_PAGE = DOCS / "plugin-kinds" / "architecture.md"
ARCHITECTURE_MARK = "<!-- example: architecture -->"


def architecture_example() -> str:
    """The code block that follows the example mark on the architecture page."""
    text = ARCHITECTURE_PAGE.read_text()
    assert ARCHITECTURE_MARK in text, f"{ARCHITECTURE_PAGE.name} lost its example"
    info, body = fenced_blocks(text[text.index(ARCHITECTURE_MARK) :])[0]
    assert info == "python"
    return body


def test_the_architecture_example_is_the_example_plugins_architecture():
    source = REPO_ROOT / "tests" / "distributions" / "example_plugin" / "patchbay_example" / "architecture.py"
    assert architecture_example() == source.read_text(), f"the page's example differs from {source}"


@pytest.mark.slow
def test_the_architecture_example_runs_and_passes_the_kit(tmp_path):
    """The page's code, executed as written: a module, registered by hand, through the whole architecture kit."""
    (tmp_path / "guide_neo.py").write_text(architecture_example())
    (tmp_path / "test_guide_neo.py").write_text(
        textwrap.dedent("""
            import pytest

            from patchbay import hookimpl
            from patchbay.contract.registry import Registry
            from patchbay.testing import ArchitectureSuite
            from patchbay.testing.tiny_models import tiny_checkpoint

            from guide_neo import TINY_GPT_NEO


            class Hooks:
                @hookimpl
                def register_architectures(self, register):
                    register("guide_neo", "guide_neo:ExampleGPTNeoArchitecture")


            class TestGuideNeo(ArchitectureSuite):
                plugin_name = "guide_neo"

                def tiny_checkpoint(self, architecture):
                    return tiny_checkpoint(architecture, TINY_GPT_NEO)

                @pytest.fixture
                def patchbay_registry(self):
                    registry = Registry.from_entry_points()
                    registry.add_plugin(Hooks(), name="guide")
                    return registry
            """)
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\b1\d passed", result.stdout), result.stdout[-2000:]
    assert "failed" not in result.stdout


def test_the_guides_check_sample_runs_every_test_of_the_sampler_suite():
    from patchbay.testing import SamplerSuite

    tests = {name.partition("[")[0] for name, _ in check_outcomes(guide_check_sample())}
    assert tests == {name for name in dir(SamplerSuite) if name.startswith("test_")}


# -- names the docs use exist: symbols, settings keys, CLI flags -------------------------------------------


DEPRECATED_NAMES = re.compile(r"^## Deprecated names\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
"""The plugin guide's section of renamed settings keys, which names keys that no longer exist."""


def inline_code(doc: Path) -> list[str]:
    """Every inline code span of ``doc``'s prose, without the backticks."""
    return [span.strip("`") for span in INLINE_CODE.findall(prose(doc.read_text()))]


def patchbay_names() -> dict[str, object]:
    """Every public name defined in a module of the ``patchbay`` package (plugins included), by name."""
    import importlib
    import pkgutil

    import patchbay
    import patchbay.plugins

    found: dict[str, object] = {}
    modules = [
        *pkgutil.walk_packages(patchbay.__path__, "patchbay."),
        *pkgutil.walk_packages(patchbay.plugins.__path__, "patchbay.plugins."),
    ]
    for module_info in modules:
        if module_info.name.endswith("__main__"):
            continue
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if not name.startswith("_") and getattr(value, "__module__", module_info.name) == module_info.name:
                found.setdefault(name, value)
    return found


def names_defined_in_examples() -> set[str]:
    """Classes and functions the docs' own code blocks and the example plugin define (they exist only there)."""
    sources = [body for doc in DOC_FILES for _, body in fenced_blocks(doc.read_text())]
    sources += [path.read_text() for path in (REPO_ROOT / "tests" / "distributions").glob("*_plugin/**/*.py")]
    return {match for source in sources for match in re.findall(r"^\s*(?:class|def)\s+(\w+)", source, re.MULTILINE)}


CAMEL_CASE = re.compile(r"^(?=[A-Za-z0-9]*[a-z])[A-Z][a-z0-9]*[A-Z][A-Za-z0-9]*$")
"""A class-like name: starts upper case, has another capital and some lower case (``KVConnectorScheduler``)."""

FOREIGN_FLAGS = {"--no-deps"}
"""Flags of other tools (pip) the docs mention in passing."""


def third_party_name(name: str) -> bool:
    """Whether ``name`` is a builtin or a public name of a library patchbay builds on.

    Such as transformers, pydantic or torch.
    """
    import builtins

    import pydantic
    import torch
    import transformers

    return any(hasattr(module, name) for module in (builtins, pydantic, torch, transformers))


MEMBER = re.compile(r"^([A-Z]\w+)\.(\w+)(?:\(\))?$")
DOTTED_MODULE = re.compile(r"^patchbay(?:\.\w+)+$")


@pytest.mark.parametrize("doc", DOC_FILES, ids=doc_id)
def test_every_class_member_and_module_the_docs_name_exists(doc: Path):
    import importlib

    known = patchbay_names()
    local = names_defined_in_examples()
    missing = []
    for span in inline_code(doc):
        if DOTTED_MODULE.match(span):
            module, _, attribute = span, "", ""
            while module:
                try:
                    obj = importlib.import_module(module)
                    break
                except ImportError:
                    module, _, last = module.rpartition(".")
                    attribute = f"{last}.{attribute}".strip(".")
            for part in filter(None, attribute.split(".")):
                obj = getattr(obj, part, None) if obj is not None else None
            if not module or obj is None:
                missing.append(f"`{span}`: no such module or attribute")
        elif (member := MEMBER.match(span)) and member.group(1) in known and isinstance(known[member.group(1)], type):
            owner = known[member.group(1)]
            fields = getattr(owner, "__dataclass_fields__", {}) | getattr(owner, "model_fields", {})
            if not hasattr(owner, member.group(2)) and member.group(2) not in fields:
                missing.append(f"`{span}`: {member.group(1)} has no {member.group(2)!r}")
        elif CAMEL_CASE.match(span) and span not in known and span not in local and not third_party_name(span):
            missing.append(f"`{span}`: no class or function of that name in patchbay or the examples")
    assert not missing, f"{doc_id(doc)} names what does not exist:\n  " + "\n  ".join(missing)


SETTINGS_KEY = re.compile(r"^(" + "|".join(Settings.model_fields) + r")\.([a-z_][a-z0-9_.]*)$")


def settings_key_exists(path: list[str]) -> bool:
    """Whether a dotted settings key exists (a free-form mapping such as ``options`` accepts any key below it)."""
    model: object = Settings
    for key in path:
        fields = getattr(model, "model_fields", None)
        if fields is None:
            return False
        if key not in fields:
            return False
        annotation = fields[key].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, Section)), None)
        if model is None:
            return True  # a leaf value, or a mapping/list whose keys are the plugin's or the request's
    return True


@pytest.mark.parametrize("doc", DOC_FILES, ids=doc_id)
def test_every_settings_key_the_docs_name_exists(doc: Path):
    missing = []
    current = DEPRECATED_NAMES.sub("", prose(doc.read_text()))  # the renamed keys' table names the old ones
    for span in (code.strip("`") for code in INLINE_CODE.findall(current)):
        if re.search(r"\.(py|md|ya?ml|toml|jsonl?|txt|safetensors|gguf)$", span):
            continue  # a file name
        if re.search(r"\.(weight|bias)$|\.\d+\.", span):
            continue  # a model parameter (`model.embed_tokens.weight`, `model.layers.0.self_attn`)
        match = SETTINGS_KEY.match(span.split("=")[0].split(":")[0].strip())
        if match and match.group(1) in SamplingParams.model_fields:
            continue  # also a request parameter (`structured_output.regex`): which one is meant is the prose's to say
        if match and not settings_key_exists(match.group(0).split(".")):
            missing.append(f"`{span}`: no such settings key")
    assert not missing, f"{doc_id(doc)} names settings that do not exist:\n  " + "\n  ".join(missing)


def subparsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub)command parser of ``patchbay`` by its command words: ``()``, ``("run",)``, ``("config", "show")``."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        found[words] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*words, name))

    walk(build_parser(), ())
    return found


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize("doc", DOC_FILES, ids=doc_id)
def test_every_cli_flag_the_docs_show_exists(doc: Path):
    parsers = subparsers()
    every_option = set().union(*(options_of(parser) for parser in parsers.values())) | {"--patchbay-strict"}
    wrong = []
    for line in documented_command_lines(doc.read_text()):
        words = line[COMMAND.match(line).start(1) :].split()
        command: tuple[str, ...] = ()
        while words and (*command, words[0]) in parsers:
            command = (*command, words.pop(0))
        for word in words:
            if command == ("check",) and not word.startswith("-"):
                break  # after KIND:NAME, arguments go to pytest
            flag = word.split("=")[0]
            if flag.startswith("-") and flag not in options_of(parsers[command]):
                wrong.append(f"`{line}`: patchbay {' '.join(command)} has no {flag}")
    for span in inline_code(doc):
        if re.fullmatch(r"--[a-z][a-z-]+", span) and span not in every_option | FOREIGN_FLAGS:
            wrong.append(f"`{span}`: no patchbay command has this flag")
    assert not wrong, f"{doc_id(doc)} shows flags the CLI does not have:\n  " + "\n  ".join(wrong)


def test_the_name_checks_catch_a_name_that_does_not_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Not vacuous: a doc naming a missing class, member, settings key or flag fails each check."""
    doc = tmp_path / "bad.md"
    doc.write_text(
        "Use `KVConnectorSchedular`, `KVConnectorWorker.save_layer`, `patchbay.testing.no_such_thing`,\n"
        "`kv_connector.stall_timout` and `patchbay check --no-such-flag sampler:greedy`.\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "doc_id", lambda path: path.name)
    for check, fragment in (
        (test_every_class_member_and_module_the_docs_name_exists, "KVConnectorSchedular"),
        (test_every_class_member_and_module_the_docs_name_exists, "has no 'save_layer'"),
        (test_every_class_member_and_module_the_docs_name_exists, "no_such_thing"),
        (test_every_settings_key_the_docs_name_exists, "kv_connector.stall_timout"),
        (test_every_cli_flag_the_docs_show_exists, "has no --no-such-flag"),
    ):
        with pytest.raises(AssertionError, match=re.escape(fragment)):
            check(doc)


# -- sample outputs are what the code prints -------------------------------------------------------------


def config_error_samples(doc: Path) -> list[tuple[str, str, str]]:
    """``(file name, YAML, error text)`` for each error sample of ``doc`` shown after the YAML that causes it."""
    blocks = fenced_blocks(doc.read_text())
    samples = []
    for (_, yaml_body), (_, error) in pairwise(blocks):
        names = set(re.findall(r"^  (\S+\.yaml): ", error, re.MULTILINE))
        if (
            error.startswith("patchbay: error: invalid configuration:\n")
            and error.count("patchbay: error") == 1
            and len(names) == 1
        ):
            samples.append((names.pop(), yaml_body, error))
    return samples


@pytest.mark.parametrize("index", range(len(config_error_samples(CONFIGURATION))))
def test_the_configuration_guides_error_samples_are_what_validation_says(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_patchbay_env: None
):
    from patchbay.contract.registry import registry_for
    from patchbay.contract.settings import ConfigError

    name, body, error = config_error_samples(CONFIGURATION)[index]
    (tmp_path / name).write_text(body)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_settings(name, registry=registry_for)
    assert f"patchbay: error: {caught.value}\n" == error


def test_the_configuration_guide_has_error_samples():
    assert len(config_error_samples(CONFIGURATION)) >= 3


def test_the_runner_names_a_device_only_to_tell_the_cpu_from_cuda():
    """docs/architecture.md: "the runner names one only where the CPU and CUDA differ" - every device name in
    the runner's step is compared with a tensor's or device's ``.type``, never used to pick or move to a device."""
    import ast

    from layering import RUNNER_STEP, WORKER

    devices = {"cpu", "cuda", "mps", "xpu", "hpu"}
    loose = []
    for module in RUNNER_STEP:
        path = WORKER / f"{module.rsplit('.', 1)[1]}.py"
        tree = ast.parse(path.read_text())
        compared = {
            id(operand)
            for node in ast.walk(tree)
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "type"
            for operand in node.comparators
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in devices and id(node) not in compared:
                loose.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {node.value!r}")
    assert not loose, "device names outside a `.type ==` test in the runner: " + ", ".join(loose)
