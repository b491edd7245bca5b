"""The kernels' C++ lives in real files the build hashes whole: every source and every header it may include."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from patchbay.plugins.attention import _cpu_kernel
from patchbay.toolkit import fused_ops, tiles as streaming_linear
from patchbay.worker.cpu import caching_allocator as heap
from patchbay.toolkit.native_build import CSRC, NativeExtension

from repo_paths import REPO_ROOT

EXTENSIONS = {
    "fused_ops": fused_ops.EXTENSION,
    "streaming_linear": streaming_linear.EXTENSION,
    "host_allocator": heap.EXTENSION,
    "paged_decode": _cpu_kernel.extension(),
}


def _tree(tmp_path: Path) -> tuple[NativeExtension, dict[str, Path]]:
    """An extension of one source beside a header of its own, with a shared include folder holding another."""
    own, shared = tmp_path / "own", tmp_path / "shared"
    own.mkdir()
    shared.mkdir()
    files = {"source": own / "kernel.cpp", "own header": own / "local.h", "shared header": shared / "simd.h"}
    for name, path in files.items():
        path.write_text(f"// {name}\n")
    (shared / "notes.txt").write_text("not C++\n")
    return NativeExtension("patchbay_test", (files["source"],), include_dirs=(shared,)), files


def test_the_build_name_changes_with_every_source_and_header(tmp_path: Path) -> None:
    extension, files = _tree(tmp_path)
    names = {extension.build_name()}
    for path in files.values():
        path.write_text(path.read_text() + "// changed\n")
        names.add(extension.build_name())
    assert len(names) == 1 + len(files), "a source or header changed without changing the build name"


def test_the_build_name_ignores_files_the_build_never_reads(tmp_path: Path) -> None:
    extension, _ = _tree(tmp_path)
    before = extension.build_name()
    (tmp_path / "shared" / "notes.txt").write_text("edited\n")
    (tmp_path / "elsewhere.h").write_text("// outside every include folder\n")
    assert extension.build_name() == before


def test_the_build_name_changes_with_the_flags(tmp_path: Path) -> None:
    extension, _ = _tree(tmp_path)
    assert extension.build_name() != extension.without_avx512().build_name()


def test_a_missing_source_is_an_error_naming_it(tmp_path: Path) -> None:
    extension, files = _tree(tmp_path)
    files["source"].unlink()
    with pytest.raises(RuntimeError, match=r"cannot build patchbay_test: its C\+\+ source .*kernel\.cpp is missing"):
        extension.build_name()


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_each_kernel_is_built_from_files_that_exist_and_hashes_the_shared_header(name: str) -> None:
    extension = EXTENSIONS[name]
    inputs = extension.inputs()
    assert all(path.is_file() for path in inputs), inputs
    assert all(path.suffix == ".cpp" for path in extension.sources)
    assert CSRC / "simd.h" in inputs


def test_every_cpp_file_belongs_to_an_extension() -> None:
    sources = {path for extension in EXTENSIONS.values() for path in extension.sources}
    found = set((REPO_ROOT / "core").rglob("*.cpp")) | set((REPO_ROOT / "plugins").rglob("*.cpp"))
    assert found == sources, f"C++ sources no extension builds: {sorted(map(str, found - sources))}"


CPP_LINE_STARTS = ("#include", "#define", "#pragma", "#if")


def cpp_strings(source: str, filename: str = "<source>") -> list[int]:
    """The lines of ``source`` (Python) where a string constant holding C++ preprocessor lines starts."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source, filename=filename))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and any(line.lstrip().startswith(CPP_LINE_STARTS) for line in node.value.splitlines())
    ]


def test_no_python_module_holds_cpp_source_in_a_string() -> None:
    offenders = [
        f"{path}:{line}"
        for root in (REPO_ROOT / "core", REPO_ROOT / "plugins")
        for path in sorted(root.rglob("*.py"))
        for line in cpp_strings(path.read_text(), str(path))
    ]
    assert offenders == [], f"C++ in Python strings (move it to a csrc/ folder): {offenders}"


@pytest.mark.parametrize(
    "source, found",
    [
        ('SOURCE = r"""\n#include <torch/extension.h>\nint f() { return 1; }\n"""\n', [1]),
        ('x = 1\nHELPERS = """\n  #if defined(__AVX2__)\n#endif\n"""\n', [2]),
        ('"""Sources may ``#include "simd.h"`` from the shared folder."""\n', []),
    ],
)
def test_the_scan_for_cpp_in_strings_finds_it(source: str, found: list[int]) -> None:
    assert cpp_strings(source) == found
