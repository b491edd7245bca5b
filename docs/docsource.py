"""Reading patchbay's source for the generated docs: fields with their docstrings, signatures, Markdown.

Shared by the generators that docs/generate_reference.py runs (the reference, the configuration
tables, the room tree). Everything is read from the source text with ``ast``, so the output does
not depend on hash seeds or memory addresses.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass, field
from types import ModuleType


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


def docstring_after(body: list[ast.stmt], index: int) -> str:
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


def signature(source: str, node: ast.FunctionDef) -> str:
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
                doc=docstring_after(node.body, index),
                owner=cls.__name__,
            )
        elif isinstance(statement, ast.FunctionDef):
            if statement.name.startswith("_") and statement.name not in ("__init__", "__call__"):
                continue
            info.methods[statement.name] = Method(
                name=statement.name,
                signature=signature(source, statement),
                decorators=_decorator_names(statement),
                doc=inspect.cleandoc(ast.get_docstring(statement, clean=False) or ""),
                owner=cls.__name__,
            )
    return info


def patchbay_bases(cls: type) -> list[type]:
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
                found.append((target.id, shown, docstring_after(tree.body, index)))
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


def anchor_of(heading: str) -> str:
    """GitHub's anchor for a heading text (lowercase, punctuation dropped, spaces to hyphens)."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")
