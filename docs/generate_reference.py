"""Generate docs/reference.md from the code, so that the reference cannot drift from it.

    python docs/generate_reference.py           # (re)write docs/reference.md
    python docs/generate_reference.py --check   # exit 1 if docs/reference.md is not what the code gives

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
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

DOCS_DIR = Path(__file__).resolve().parent
REFERENCE = DOCS_DIR / "reference.md"

COMMON_MODULE = "patchbay.interfaces.base"
# Two kinds share patchbay.interfaces.attention (and two patchbay.interfaces.lora); these classes go under the builder's kind (the builder
# consumes CommonAttentionMetadata); the module's other classes go under the kind listed first in KINDS.
KIND_OF_SHARED_CLASS = {
    "AttentionMetadataBuilder": "attention_metadata_builder",
    "CommonAttentionMetadata": "attention_metadata_builder",
    "LoRAResolver": "lora_resolver",
    "LoRAResolverCapabilities": "lora_resolver",
    "LoRAResolveError": "lora_resolver",
}


# -- reading the source ----------------------------------------------------------------------------


@dataclass
class Attribute:
    """One annotated assignment in a class body: a dataclass field, a class attribute, a protocol member."""

    name: str
    annotation: str
    default: str | None
    doc: str
    owner: str


@dataclass
class Method:
    name: str
    signature: str
    decorators: list[str]
    doc: str
    owner: str


@dataclass
class ClassInfo:
    name: str
    module: str
    cls: type
    node: ast.ClassDef
    source: str
    attributes: dict[str, Attribute] = field(default_factory=dict)
    methods: dict[str, Method] = field(default_factory=dict)


_MODULE_TREES: dict[str, tuple[str, ast.Module]] = {}


def module_tree(module: ModuleType) -> tuple[str, ast.Module]:
    """The source and syntax tree of ``module`` (parsed once)."""
    if module.__name__ not in _MODULE_TREES:
        source = inspect.getsource(module)
        _MODULE_TREES[module.__name__] = (source, ast.parse(source))
    return _MODULE_TREES[module.__name__]


def _segment(source: str, node: ast.AST | None) -> str | None:
    if node is None:
        return None
    text = ast.get_source_segment(source, node) or ast.unparse(node)
    return " ".join(text.split())


def _render_default(source: str, node: ast.AST | None) -> str | None:
    """The default as written; ``field(default_factory=dict)`` is shown as ``dict()``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "field":
        for keyword in node.keywords:
            if keyword.arg == "default_factory":
                return f"{_segment(source, keyword.value)}()"
            if keyword.arg == "default":
                return _segment(source, keyword.value)
        return None
    return _segment(source, node)


def _docstring_after(body: list[ast.stmt], index: int) -> str:
    """The string literal right after statement ``index`` (a field docstring), or ``""``."""
    if index + 1 < len(body):
        nxt = body[index + 1]
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            return inspect.cleandoc(nxt.value.value)
    return ""


def _decorator_names(node: ast.FunctionDef) -> list[str]:
    names = []
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.append(ast.unparse(target).rsplit(".", 1)[-1])
    return names


def _parameter(source: str, arg: ast.arg, default: ast.expr | None, prefix: str = "") -> str:
    text = prefix + arg.arg
    if arg.annotation is not None:
        text += f": {_segment(source, arg.annotation)}"
    if default is not None:
        text += f" = {_segment(source, default)}" if arg.annotation is not None else f"={_segment(source, default)}"
    return text


def _signature(source: str, node: ast.FunctionDef) -> str:
    """``name(parameters) -> returns`` with annotations and defaults as written in the source."""
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts = [_parameter(source, arg, default) for arg, default in zip(positional, defaults)]
    if args.posonlyargs:
        parts.insert(len(args.posonlyargs), "/")
    if args.vararg is not None:
        parts.append(_parameter(source, args.vararg, None, "*"))
    elif args.kwonlyargs:
        parts.append("*")
    parts += [_parameter(source, arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        parts.append(_parameter(source, args.kwarg, None, "**"))
    returns = f" -> {_segment(source, node.returns)}" if node.returns is not None else ""
    return f"{node.name}({', '.join(parts)}){returns}"


def class_info(cls: type) -> ClassInfo:
    """Own attributes and methods of ``cls``, from its source."""
    module = sys.modules[cls.__module__]
    source, tree = module_tree(module)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    info = ClassInfo(cls.__name__, cls.__module__, cls, node, source)
    for index, statement in enumerate(node.body):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            name = statement.target.id
            info.attributes[name] = Attribute(
                name=name,
                annotation=_segment(source, statement.annotation) or "",
                default=_render_default(source, statement.value),
                doc=_docstring_after(node.body, index),
                owner=cls.__name__,
            )
        elif isinstance(statement, ast.FunctionDef):
            if statement.name.startswith("_") and statement.name not in ("__init__", "__call__"):
                continue
            info.methods[statement.name] = Method(
                name=statement.name,
                signature=_signature(source, statement),
                decorators=_decorator_names(statement),
                doc=inspect.cleandoc(ast.get_docstring(statement, clean=False) or ""),
                owner=cls.__name__,
            )
    return info


def _patchbay_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__[1:] if base.__module__.startswith("patchbay.")]


def module_constants(module: ModuleType, names: set[str]) -> list[tuple[str, str, str]]:
    """``(name, value, doc)`` of module-level assignments named in ``names``, in source order."""
    source, tree = module_tree(module)
    found = []
    for index, statement in enumerate(tree.body):
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
            if isinstance(target, ast.Name) and target.id in names:
                value = getattr(module, target.id)
                if isinstance(value, (set, frozenset)):
                    shown = "frozenset({" + ", ".join(repr(item) for item in sorted(value)) + "})"
                else:
                    shown = _segment(source, statement.value) or ""
                found.append((target.id, shown, _docstring_after(tree.body, index)))
    return found


# -- docstrings to Markdown --------------------------------------------------------------------------


_ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|exc|obj):`(~?)([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


class Linker:
    """Turns a dotted name into a link to its section when the reference documents it."""

    def __init__(self) -> None:
        self.anchors: dict[str, str] = {}

    def add(self, name: str, anchor: str) -> None:
        self.anchors[name] = anchor

    def link(self, text: str, target: str) -> str:
        for part in target.split("."):
            if part in self.anchors:
                return f"[`{text}`](#{self.anchors[part]})"
        return f"`{text}`"


def inline(text: str, linker: Linker) -> str:
    """reST inline markup to Markdown: ````x```` and ``:class:`x``` become code, linked where documented."""
    text = _LITERAL.sub(lambda m: f"`{m.group(1)}`", text)  # may span a line break

    def role(match: re.Match[str]) -> str:
        short, target = match.group(1), match.group(2)
        shown = target.rsplit(".", 1)[-1] if short else target
        return linker.link(shown, target)

    return _ROLE.sub(role, text)


def _fence_language(block: list[str]) -> str:
    first = next((line.strip() for line in block if line.strip()), "")
    if first.startswith("["):
        return "toml"
    if first.startswith(("from ", "import ", "def ", "@", "class ")):
        return "python"
    return "text"


def docstring_markdown(doc: str, linker: Linker) -> str:
    """A cleaned docstring as Markdown: literal blocks (``::``) fenced, definition lists as bullets."""
    lines = doc.splitlines()
    chunks: list[tuple[str, str]] = []  # ("text", markup to convert) or ("code", verbatim)
    index = 0
    while index < len(lines):
        line = lines[index]
        stripped = line.rstrip()
        if stripped.endswith("::"):
            # "text::" introduces a literal block and reads "text:"; a lone "::" disappears.
            lead = stripped[:-2].rstrip()
            if lead:
                chunks.append(("text", lead + ":"))
            index += 1
            block: list[str] = []
            while index < len(lines) and (not lines[index].strip() or lines[index].startswith((" ", "\t"))):
                block.append(lines[index])
                index += 1
            while block and not block[-1].strip():
                block.pop()
            body = textwrap.dedent("\n".join(block)).strip("\n")
            chunks.append(("code", f"\n```{_fence_language(block)}\n{body}\n```\n"))
            continue
        next_line = lines[index + 1] if index + 1 < len(lines) else ""
        if stripped and not line.startswith(" ") and next_line.startswith(" ") and next_line.strip():
            # A definition-list entry: a term, then its indented description.
            index += 1
            body_lines = []
            while index < len(lines) and lines[index].startswith(" "):
                body_lines.append(lines[index].strip())
                index += 1
            chunks.append(("text", f"- **{stripped}**: {' '.join(body_lines)}"))
            continue
        chunks.append(("text", stripped))
        index += 1

    out: list[str] = []
    run: list[str] = []
    for kind, text in chunks:
        if kind == "text":
            run.append(text)
            continue
        out.append(inline("\n".join(run), linker))
        run = []
        out.append(text)
    out.append(inline("\n".join(run), linker))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


# -- rendering ---------------------------------------------------------------------------------------


def anchor_of(heading: str) -> str:
    """GitHub's anchor for a heading text (lowercase, punctuation dropped, spaces to hyphens)."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


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

    chain = [cls, *_patchbay_bases(cls)]

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
        lines += [f"#### `{cls.__name__}.{method.name}`{must}", "", "```python", f"{prefix}def {method.signature}",
                  "```", ""]
        if method.doc:
            lines += [docstring_markdown(method.doc, linker), ""]
        else:
            base = next((b for b in _patchbay_bases(cls) if b in infos and method.name in infos[b].methods
                         and infos[b].methods[method.name].doc), None)
            if base is not None:
                lines += [f"Overrides {linker.link(f'{base.__name__}.{method.name}', base.__name__)}.", ""]

    inherited: dict[str, list[str]] = {}
    listed = set(info.methods)
    for base in _patchbay_bases(cls):
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
    missing = sorted(public - documented)
    if missing:
        raise SystemExit(f"generate_reference: patchbay.interfaces exports {missing}, which no section shows; "
                         "place them with KIND_OF_SHARED_CLASS")

    all_classes = [*common_classes, *(cls for classes in by_kind.values() for cls in classes),
                   hookspecs.RegisterCallback]
    infos: dict[type, ClassInfo] = {}
    for cls in all_classes:
        for klass in (cls, *_patchbay_bases(cls)):
            if klass not in infos:
                infos[klass] = class_info(klass)
    hooks = [name for name, value in vars(hookspecs).items()
             if callable(value) and hasattr(value, f"{hookspecs.PROJECT_NAME}_spec")]
    for cls in all_classes:
        linker.add(cls.__name__, anchor_of(cls.__name__))
    for hook in hooks:
        linker.add(hook, anchor_of(hook))
    for constants in constants_by_module.values():
        for name, _, _ in constants:
            linker.add(name, anchor_of(name))

    lines = [
        "# Reference: hook specifications and plugin interfaces",
        "",
        "<!-- Generated by docs/generate_reference.py from the code. Do not edit by hand: run",
        "     `python docs/generate_reference.py` (tests/test_docs.py fails when this file is stale). -->",
        "",
        "This page is generated from the docstrings and source of `patchbay.contract.hookspecs` and",
        "`patchbay.interfaces`. For a guided tour with a worked example, read the",
        "[plugin guide](plugin-guide.md).",
        "",
        "- [Registration hooks](#registration-hooks)",
        "- [What every kind shares](#what-every-kind-shares)",
    ]
    for kind in KINDS.values():
        lines.append(f"- [Kind `{kind.name}`](#{anchor_of(f'Kind {kind.name}')})")
    lines += ["", "## Registration hooks", "", f"`{hookspecs.__name__}`", ""]
    lines += [docstring_markdown(inspect.cleandoc(hookspecs.__doc__ or ""), linker), ""]

    source, tree = module_tree(hookspecs)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for hook in hooks:
        node = functions[hook]
        kinds = [k for k in KINDS.values() if k.hook == hook]
        lines += [f"### {hook}", "", "```python", "@hookspec", f"def {_signature(source, node)}", "```", ""]
        if kinds:
            kind = kinds[0]
            lines += [f"Kind `{kind.name}` ({kind.label}); implementations subclass "
                      f"{linker.link(kind.interface.__name__, kind.interface.__name__)}.", ""]
        lines += [docstring_markdown(inspect.cleandoc(ast.get_docstring(node, clean=False) or ""), linker), ""]
    lines += render_class(hookspecs.RegisterCallback, infos, linker)

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
            lines += [f"`{module.__name__}`", "", docstring_markdown(inspect.cleandoc(module.__doc__ or ""), linker), ""]
        for name, value, doc in constants_by_module[kind.name]:
            lines += [f"### {name}", "", f"`{module.__name__}.{name}`", "", "```python", f"{name} = {value}", "```", ""]
            if doc:
                lines += [docstring_markdown(doc, linker), ""]
        for cls in by_kind[kind.name]:
            lines += render_class(cls, infos, linker)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md differs from the code")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = REFERENCE.read_text() if REFERENCE.exists() else ""
        if current == text:
            print(f"{REFERENCE.relative_to(DOCS_DIR.parent)} is up to date")
            return 0
        diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "docs/reference.md (file)",
                                    "docs/reference.md (from the code)", lineterm="", n=1)
        print("\n".join(list(diff)[:60]))
        print(f"\n{REFERENCE.relative_to(DOCS_DIR.parent)} is out of date; run: python docs/generate_reference.py",
              file=sys.stderr)
        return 1
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE.relative_to(DOCS_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
