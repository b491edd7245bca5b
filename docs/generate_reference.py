"""Generate the docs that describe the code from the code, so that they cannot drift from it.

    python docs/generate_reference.py           # (re)write every generated page and block
    python docs/generate_reference.py --check   # exit 1 if any of them is not what the code gives

It writes docs/reference.md and docs/design/modules.md whole, and the marked blocks of
hand-written pages: the key tables of docs/configuration.md (``settings_tables.py``: from the
settings models' field docstrings), the room table of docs/architecture.md (``rooms.py``: from
the packages' docstrings), and docs/serving.md's table of typed flags and of the OpenAI fields
patchbay does not use (from ``patchbay.entrypoints.cli_flags`` and ``.serve.unused_fields``).
A marked block runs from ``<!-- generated: NAME -->`` to ``<!-- end generated: NAME -->``; the
text around it is hand-written and kept.

Everything in the reference comes from the source: the hook specs of
``patchbay.contract.hookspecs`` (signatures and docstrings, with the module docstring
as the introduction), then for each kind of ``patchbay.contract.registry.KINDS`` the
public classes of its interface module, with their fields (names, annotations,
defaults and the docstring under each field, read from the source with
``ast``), class attributes and methods (signatures as written, docstrings,
abstract methods marked "must implement").  Signatures and defaults are the
source text, not ``repr`` of live objects, so the output does not depend on
hash seeds or memory addresses.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from patchbay.contract.kinds import ChoiceSite

from docsource import (
    Attribute,
    ClassInfo,
    Linker,
    patchbay_bases,
    signature,
    anchor_of,
    class_info,
    docstring_markdown,
    inline,
    module_constants,
    module_tree,
)

DOCS_DIR = Path(__file__).resolve().parent
REFERENCE = DOCS_DIR / "reference.md"
CONFIGURATION = DOCS_DIR / "configuration.md"
ARCHITECTURE = DOCS_DIR / "architecture.md"
MODULE_INDEX = DOCS_DIR / "design" / "modules.md"
PLUGIN_GUIDE = DOCS_DIR / "plugin-guide.md"
LAYERING = DOCS_DIR / "design" / "layering.md"
README = DOCS_DIR.parent / "README.md"
SERVING = DOCS_DIR / "serving.md"
MARKED_BLOCK = re.compile(r"(<!-- generated: (\S+) -->\n).*?(<!-- end generated: \2 -->)", re.DOTALL)

COMMON_MODULE = "patchbay.interfaces.base"
HELPER_MODULES = {"tool_parser": ("Parsing helpers", "patchbay.interfaces.parsing")}
"""Modules of public helper functions outside ``patchbay.interfaces.__all__``, shown after a kind's classes
under a heading of their own (kind -> (heading, module))."""
# Two kinds share patchbay.interfaces.attention (and two patchbay.interfaces.lora); these classes go under the builder's kind (the builder
# consumes CommonAttentionMetadata); the module's other classes go under the kind listed first in KINDS.
KIND_OF_SHARED_CLASS = {
    "AttentionMetadataBuilder": "attention_metadata_builder",
    "CommonAttentionMetadata": "attention_metadata_builder",
    "LoRAResolver": "lora_resolver",
    "LoRAResolverCapabilities": "lora_resolver",
    "LoRAResolveError": "lora_resolver",
}


# -- rendering ---------------------------------------------------------------------------------------


def _bullet(entry: str, doc: str, linker: Linker) -> list[str]:
    if not doc:
        return [f"- {entry}"]
    paragraphs = docstring_markdown(doc, linker).split("\n\n")
    lines = [f"- {entry}: {paragraphs[0]}".replace("\n", " ")]
    for paragraph in paragraphs[1:]:
        lines.append("")
        lines.append(textwrap.indent(paragraph, "  "))
    return lines


def _attribute_lines(attribute: Attribute, cls: type, linker: Linker) -> list[str]:
    """One bullet; an attribute inherited from a documented base links there instead of repeating its doc."""
    text = f"`{attribute.name}: {attribute.annotation}"
    if attribute.default is not None:
        text += f" = {attribute.default}"
    text += "`"
    if attribute.owner != cls.__name__:
        return [f"- {text} (from {linker.link(attribute.owner, attribute.owner)})"]
    return _bullet(text, attribute.doc, linker)


def render_class(cls: type, infos: dict[type, ClassInfo], linker: Linker) -> list[str]:
    info = infos[cls]
    bases = ", ".join(base.__name__ for base in cls.__bases__ if base is not object)
    lines = [f"### {cls.__name__}", ""]
    kind_line = "dataclass" if dataclasses.is_dataclass(cls) else "class"
    if dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        kind_line = "frozen dataclass"
    if inspect.isabstract(cls):
        kind_line = "abstract class"
    lines.append(f"`{info.module}.{cls.__name__}` — {kind_line}" + (f", bases: `{bases}`" if bases else ""))
    lines.append("")
    doc = inspect.cleandoc(ast.get_docstring(info.node, clean=False) or "")
    if doc:
        lines += [docstring_markdown(doc, linker), ""]

    chain = [cls, *patchbay_bases(cls)]

    def find_attribute(name: str) -> Attribute | None:
        for klass in chain:
            if klass in infos and name in infos[klass].attributes:
                return infos[klass].attributes[name]
        return None

    if dataclasses.is_dataclass(cls):
        entries = []
        for dc_field in dataclasses.fields(cls):
            attribute = find_attribute(dc_field.name)
            if attribute is None:
                continue
            entries += _attribute_lines(attribute, cls, linker)
        if entries:
            lines += ["**Fields**", "", *entries, ""]

    # Class attributes: ClassVars of the class and of its patchbay bases (nearest definition wins),
    # or every annotated member of a non-dataclass (a Protocol's members).
    seen: set[str] = set()
    class_attributes = []
    for klass in chain:
        if klass not in infos:
            continue
        for attribute in infos[klass].attributes.values():
            is_classvar = attribute.annotation.startswith("ClassVar")
            if attribute.name in seen or (dataclasses.is_dataclass(cls) and not is_classvar):
                continue
            seen.add(attribute.name)
            class_attributes += _attribute_lines(attribute, cls, linker)
    if class_attributes:
        lines += ["**Class attributes**" if not _is_protocol(cls) else "**Members**", "", *class_attributes, ""]

    abstract = set(getattr(cls, "__abstractmethods__", ()))
    for method in info.methods.values():
        decorators = [d for d in method.decorators if d in ("classmethod", "staticmethod", "property")]
        prefix = "".join(f"@{d}\n" for d in decorators)
        must = " — **must implement**" if method.name in abstract else ""
        lines += [
            f"#### `{cls.__name__}.{method.name}`{must}",
            "",
            "```python",
            f"{prefix}def {method.signature}",
            "```",
            "",
        ]
        if method.doc:
            lines += [docstring_markdown(method.doc, linker), ""]
        else:
            base = next(
                (
                    b
                    for b in patchbay_bases(cls)
                    if b in infos and method.name in infos[b].methods and infos[b].methods[method.name].doc
                ),
                None,
            )
            if base is not None:
                lines += [f"Overrides {linker.link(f'{base.__name__}.{method.name}', base.__name__)}.", ""]

    inherited: dict[str, list[str]] = {}
    listed = set(info.methods)
    for base in patchbay_bases(cls):
        if base not in infos:
            continue
        for name in infos[base].methods:
            if name in listed:
                continue  # overridden here, or listed from a nearer base
            listed.add(name)
            mark = " (must implement)" if name in abstract else ""
            inherited.setdefault(base.__name__, []).append(f"`{name}`{mark}")
    if inherited:
        parts = [f"{linker.link(base, base)}: {', '.join(names)}" for base, names in inherited.items()]
        lines += ["Inherited methods: " + "; ".join(parts) + ".", ""]
    return lines


def _is_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


def _classes_in(module: ModuleType, public: set[str]) -> list[type]:
    """Public classes defined in ``module``, in source order."""
    _, tree = module_tree(module)
    names = [node.name for node in tree.body if isinstance(node, ast.ClassDef) and node.name in public]
    return [getattr(module, name) for name in names]


def module_functions(module: ModuleType, names: set[str]) -> list[tuple[str, str, str]]:
    """``(name, signature, doc)`` of the module's functions named in ``names``, in source order."""
    source, tree = module_tree(module)
    return [
        (node.name, signature(source, node), inspect.cleandoc(ast.get_docstring(node, clean=False) or ""))
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in names
    ]


def contract_versions_section() -> list[str]:
    """The table of each kind's current contract version and the list of what each version changed."""
    from patchbay.contract import versions
    from patchbay.contract.registry import KINDS

    lines = [
        "## Contract versions",
        "",
        f"`{versions.__name__}.CONTRACT_VERSIONS`: the contract of each kind this patchbay provides. An "
        "implementation declares the version it was built against in `contract_version`; the "
        "[plugin guide](plugin-guide.md#contract-versions-and-deprecation-policy) says which versions load.",
        "",
        "| kind | contract | what it is |",
        "|---|---|---|",
    ]
    for kind in KINDS.values():
        lines.append(f"| `{kind.name}` | {versions.CONTRACT_VERSIONS[kind.name]} | {kind.label} |")
    lines += ["", "What each version added (`CHANGES`):", ""]
    lines += [f"- {version}: {change}" for version, change in versions.CHANGES.items()]
    return [*lines, ""]


def helper_section(heading: str, module_name: str, linker: Linker) -> list[str]:
    """A helper module's docstring and its public functions, under ``heading``."""
    module = importlib.import_module(module_name)
    _, tree = module_tree(module)
    public = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
    lines = [f"### {heading}", "", f"`{module_name}`", ""]
    lines += [docstring_markdown(inspect.cleandoc(module.__doc__ or ""), linker), ""]
    for name, shown, doc in module_functions(module, public):
        lines += [f"#### {name}", "", "```python", f"def {shown}", "```", ""]
        if doc:
            lines += [docstring_markdown(doc, linker), ""]
    return lines


def render() -> str:
    """The whole reference, as Markdown."""
    from patchbay import interfaces
    from patchbay.contract import hookspecs
    from patchbay.contract.registry import KINDS

    public = set(interfaces.__all__)
    linker = Linker()

    # Which classes go under which heading.
    common_module = importlib.import_module(COMMON_MODULE)
    common_classes = _classes_in(common_module, public)
    by_kind: dict[str, list[type]] = {}
    for kind in KINDS.values():
        module = importlib.import_module(kind.interface.__module__)
        classes = []
        for cls in _classes_in(module, public):
            owner = KIND_OF_SHARED_CLASS.get(cls.__name__)
            if owner is None:
                sharing = [k.name for k in KINDS.values() if k.interface.__module__ == module.__name__]
                owner = sharing[0]
            if owner == kind.name:
                classes.append(cls)
        # The interface first, then the rest in source order.
        classes.sort(key=lambda cls: cls is not kind.interface)
        by_kind[kind.name] = classes

    documented = {cls.__name__ for cls in common_classes} | {cls.__name__ for c in by_kind.values() for cls in c}
    # Public module-level values (SAMPLING_PARAMS, ...) go under the first kind of their module.
    constants_by_module: dict[str, list[tuple[str, str, str]]] = {}
    modules_done: set[str] = set()
    for kind in KINDS.values():
        module = importlib.import_module(kind.interface.__module__)
        first = module.__name__ not in modules_done
        modules_done.add(module.__name__)
        constants_by_module[kind.name] = module_constants(module, public - documented) if first else []
    documented |= {name for constants in constants_by_module.values() for name, _, _ in constants}
    # Public module-level helper functions (token_bytes, sign_entry, ...) go under the first kind of their module.
    functions_by_kind: dict[str, list[tuple[str, str, str]]] = {}
    modules_done = set()
    for kind in KINDS.values():
        module = importlib.import_module(kind.interface.__module__)
        first = module.__name__ not in modules_done
        modules_done.add(module.__name__)
        functions_by_kind[kind.name] = module_functions(module, public - documented) if first else []
    documented |= {name for functions in functions_by_kind.values() for name, _, _ in functions}
    missing = sorted(public - documented)
    if missing:
        raise SystemExit(
            f"generate_reference: patchbay.interfaces exports {missing}, which no section shows; "
            "place them with KIND_OF_SHARED_CLASS"
        )

    all_classes = [
        *common_classes,
        *(cls for classes in by_kind.values() for cls in classes),
        hookspecs.RegisterCallback,
    ]
    infos: dict[type, ClassInfo] = {}
    for cls in all_classes:
        for klass in (cls, *patchbay_bases(cls)):
            if klass not in infos:
                infos[klass] = class_info(klass)
    hooks = [
        name
        for name, value in vars(hookspecs).items()
        if callable(value) and hasattr(value, f"{hookspecs.PROJECT_NAME}_spec")
    ]
    for cls in all_classes:
        linker.add(cls.__name__, anchor_of(cls.__name__))
    for hook in hooks:
        linker.add(hook, anchor_of(hook))
    for constants in constants_by_module.values():
        for name, _, _ in constants:
            linker.add(name, anchor_of(name))
    for functions in functions_by_kind.values():
        for name, _, _ in functions:
            linker.add(name, anchor_of(name))

    lines = [
        "# Reference: hook specifications and plugin interfaces",
        "",
        "<!-- Generated by docs/generate_reference.py from the code. Do not edit by hand: run",
        "     `python docs/generate_reference.py` (tests/project/test_docs.py fails when this file is stale). -->",
        "",
        "This page is generated from the docstrings and source of `patchbay.contract.hookspecs` and",
        "`patchbay.interfaces`. For a guided tour with a worked example, read the",
        "[plugin guide](plugin-guide.md).",
        "",
        "- [Registration hooks](#registration-hooks)",
        "- [Contract versions](#contract-versions)",
        "- [What every kind shares](#what-every-kind-shares)",
    ]
    for kind in KINDS.values():
        lines.append(f"- [Kind `{kind.name}`](#{anchor_of(f'Kind {kind.name}')})")
    lines.append("- [The plugin toolkit](#the-plugin-toolkit)")
    lines += ["", "## Registration hooks", "", f"`{hookspecs.__name__}`", ""]
    lines += [docstring_markdown(inspect.cleandoc(hookspecs.__doc__ or ""), linker), ""]

    source, tree = module_tree(hookspecs)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for hook in hooks:
        node = functions[hook]
        kinds = [k for k in KINDS.values() if k.hook == hook]
        lines += [f"### {hook}", "", "```python", "@hookspec", f"def {signature(source, node)}", "```", ""]
        if kinds:
            kind = kinds[0]
            lines += [
                f"Kind `{kind.name}` ({kind.label}); implementations subclass "
                f"{linker.link(kind.interface.__name__, kind.interface.__name__)}.",
                "",
            ]
        lines += [docstring_markdown(inspect.cleandoc(ast.get_docstring(node, clean=False) or ""), linker), ""]
    lines += render_class(hookspecs.RegisterCallback, infos, linker)
    lines += contract_versions_section()

    lines += ["## What every kind shares", "", f"`{COMMON_MODULE}`", ""]
    lines += [docstring_markdown(inspect.cleandoc(common_module.__doc__ or ""), linker), ""]
    for cls in common_classes:
        lines += render_class(cls, infos, linker)

    shown_module_docs: set[str] = set()
    for kind in KINDS.values():
        module = importlib.import_module(kind.interface.__module__)
        lines += [f"## Kind `{kind.name}`", ""]
        lines += [
            f"{kind.label[0].upper()}{kind.label[1:]}: registered through "
            f"[`{kind.hook}`](#{anchor_of(kind.hook)}); implementations are subclasses of "
            f"{linker.link(kind.interface.__name__, kind.interface.__name__)}; an implementation is referred to "
            f"as `{kind.name}:NAME` (as in `patchbay check {kind.name}:NAME`).",
            "",
        ]
        if module.__name__ not in shown_module_docs:
            shown_module_docs.add(module.__name__)
            lines += [
                f"`{module.__name__}`",
                "",
                docstring_markdown(inspect.cleandoc(module.__doc__ or ""), linker),
                "",
            ]
        for name, value, doc in constants_by_module[kind.name]:
            lines += [f"### {name}", "", f"`{module.__name__}.{name}`", "", "```python", f"{name} = {value}", "```", ""]
            if doc:
                lines += [docstring_markdown(doc, linker), ""]
        for name, shown, doc in functions_by_kind[kind.name]:
            lines += [f"### {name}", "", f"`{module.__name__}.{name}`", "", "```python", f"def {shown}", "```", ""]
            if doc:
                lines += [docstring_markdown(doc, linker), ""]
        for cls in by_kind[kind.name]:
            lines += render_class(cls, infos, linker)
        if kind.name in HELPER_MODULES:
            lines += helper_section(*HELPER_MODULES[kind.name], linker)
    lines += toolkit_section(linker)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip("\n") + "\n"


TOOLKIT_MODULES = ("native_build", "cpu", "tiles", "block_tiles", "fused_ops", "int8_kv", "paths", "model_files", "hidden_states")
"""The toolkit's modules, in the order the reference shows them (a test checks it names every module)."""


def toolkit_section(linker: Linker) -> list[str]:
    """The plugin toolkit: its version, then each module's docstring and the first line of each public name's."""
    import patchbay.toolkit as toolkit
    from patchbay.contract.versions import TOOLKIT_CHANGES, TOOLKIT_VERSION

    lines = ["## The plugin toolkit", "", "`patchbay.toolkit`", ""]
    lines += [docstring_markdown(inspect.cleandoc(toolkit.__doc__ or ""), linker), ""]
    lines += [f"Version **{TOOLKIT_VERSION}**. Changes by version:", ""]
    lines += [f"- {version}: {change}" for version, change in TOOLKIT_CHANGES.items()]
    lines.append("")
    for name in TOOLKIT_MODULES:
        module = importlib.import_module(f"patchbay.toolkit.{name}")
        summary = inspect.cleandoc(module.__doc__ or "").split("\n\n")[0]
        lines += [f"### `patchbay.toolkit.{name}`", "", docstring_markdown(summary, linker), ""]
        lines += ["| name | what it is |", "|---|---|"]
        constants = {name: doc for name, _, doc in module_constants(module, set(module.__all__))}
        for public in sorted(module.__all__):
            value = getattr(module, public)
            doc = constants.get(public) or (inspect.getdoc(value) if public not in constants else None)
            line = re.split(r"(?<=\.)\s", (doc or "").strip().split("\n\n")[0].replace("\n", " "))[0]
            if not line:
                raise SystemExit(f"generate_reference: patchbay.toolkit.{name}.{public} has no docstring")
            lines.append(f"| `{public}` | {inline(line, linker).replace('|', chr(92) + '|')} |")
        lines.append("")
    return lines


def fill_marked_blocks(text: str, blocks: dict[str, str], page: Path) -> str:
    """``text`` with each marked block's body replaced by ``blocks[NAME]``; every block must be marked once."""
    seen: list[str] = []

    def fill(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in blocks:
            raise SystemExit(
                f"generate_reference: {page.name} marks a block {name!r} that nothing generates "
                f"(known: {', '.join(blocks)})"
            )
        seen.append(name)
        return f"{match.group(1)}{blocks[name]}{match.group(3)}"

    filled = MARKED_BLOCK.sub(fill, text)
    missing = [name for name in blocks if name not in seen]
    if missing:
        raise SystemExit(
            f"generate_reference: {page.name} has no markers for {', '.join(missing)}; add "
            "<!-- generated: NAME --> and <!-- end generated: NAME --> lines where each belongs"
        )
    return filled


def choice_yaml(site: ChoiceSite) -> str:
    """How settings choose a plugin at ``site``: ``sampler: {name: NAME, options: {...}}``."""
    text = "{name: NAME, options: {...}}"
    for part in reversed(site.path):
        text = f"{{{part}: {text}}}" if part != site.path[0] else f"{part}: {text}"
    return f"`{text}`"


def kinds_block() -> dict[str, str]:
    """The plugin guide's table of kinds: each kind's hook, interface, settings keys and purpose."""
    from patchbay.contract.kinds import KINDS

    lines = ["| kind | hook | subclass | chosen in settings by | write one when |", "|---|---|---|---|---|"]
    for kind in KINDS.values():
        chosen = "; ".join(choice_yaml(site) for site in kind.choices) or "the runner"
        lines.append(
            f"| `{kind.name}` | `{kind.hook}` | `{kind.interface.__name__}` | {chosen} | {kind.purpose} |"
        )
    return {"kinds": "\n".join(lines) + "\n"}


def serving_blocks() -> dict[str, str]:
    """docs/serving.md's tables: the typed flags with their settings keys, and the OpenAI fields patchbay
    accepts without using them or only at their neutral values."""
    from patchbay.entrypoints.cli_flags import FLAGS, flag_usage
    from patchbay.entrypoints.serve.unused_fields import IGNORED, NEUTRAL_ONLY

    flags = ["| flag | settings key | commands |", "|---|---|---|"]
    for flag in FLAGS:
        key = f"`{flag.key}`" + (" (given with its defaults)" if flag.kind == "section" else "")
        flags.append(f"| `{flag_usage(flag)}` | {key} | {', '.join(flag.commands)} |")
    ignored = ["| endpoint | field | why patchbay has no use for it |", "|---|---|---|"]
    for endpoint, fields in IGNORED.items():
        ignored += [f"| `{endpoint}` | `{name}` | {why} |" for name, why in fields.items()]
    neutral = ["| endpoint | field | accepted | any other value |", "|---|---|---|---|"]
    for endpoint, rules in NEUTRAL_ONLY.items():
        neutral += [
            f"| `{endpoint}` | `{name}` | {rule.neutral} | 400: {rule.why} |" for name, rule in rules.items()
        ]
    return {
        "serve-flags": "\n".join(flags) + "\n",
        "ignored-fields": "\n".join(ignored) + "\n",
        "neutral-fields": "\n".join(neutral) + "\n",
    }


def generated_pages() -> dict[Path, str]:
    """Every generated page's text as the code makes it, by path."""
    from rooms import module_index, readme_layout, room_blocks
    from settings_tables import settings_blocks

    rooms, rules = room_blocks()
    return {
        REFERENCE: render(),
        CONFIGURATION: fill_marked_blocks(CONFIGURATION.read_text(), settings_blocks(CONFIGURATION), CONFIGURATION),
        ARCHITECTURE: fill_marked_blocks(ARCHITECTURE.read_text(), rooms, ARCHITECTURE),
        LAYERING: fill_marked_blocks(LAYERING.read_text(), rules, LAYERING),
        MODULE_INDEX: module_index(),
        PLUGIN_GUIDE: fill_marked_blocks(PLUGIN_GUIDE.read_text(), kinds_block(), PLUGIN_GUIDE),
        README: fill_marked_blocks(README.read_text(), readme_layout(), README),
        SERVING: fill_marked_blocks(SERVING.read_text(), serving_blocks(), SERVING),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated page differs from the code")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated_pages().items():
        name = path.relative_to(DOCS_DIR.parent)
        current = path.read_text() if path.exists() else ""
        if current == text:
            print(f"{name} is up to date")
            continue
        if not args.check:
            path.write_text(text)
            print(f"wrote {name}")
            continue
        stale.append(str(name))
        diff = difflib.unified_diff(
            current.splitlines(), text.splitlines(), f"{name} (file)", f"{name} (from the code)", lineterm="", n=1
        )
        print("\n".join(list(diff)[:60]))
    if stale:
        print(f"\n{', '.join(stale)} out of date; run: python docs/generate_reference.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
