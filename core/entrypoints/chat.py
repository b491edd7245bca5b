"""Chat with tools and reasoning, shared by ``patchbay serve`` and :meth:`patchbay.LLM.chat`.

Three jobs, in a request's order:

1. :func:`plan_tools` checks ``tools``, ``tool_choice`` and
   ``parallel_tool_calls`` and decides how calls are obtained: ``auto``
   leaves the model free and reads its answer with the run's tool parser;
   ``required`` and a named function constrain decoding with a JSON schema
   built from the tools' parameters (the run's structured-output backend
   enforces it, as compact JSON unless ``chat.compact_tool_calls`` is off),
   so the answer is the calls' JSON itself.
2. :func:`template_messages` checks the conversation (each ``tool`` message
   answers a call an earlier assistant message made) and
   :func:`render_chat` renders it and the tools with the chat template.
3. :class:`AnswerReader` splits the answer, whole or streamed, into
   reasoning, content and calls, with the same result either way.  An
   enforced answer cut short (``max_tokens``) keeps the calls it completed;
   the cut one is dropped, never passed off as content.

Bad input raises :class:`ChatRequestError` naming the field at fault.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from patchbay.contract.settings import plugin_options
from patchbay.interfaces import ReasoningParser, ReasoningStream, ToolCall, ToolCallStream, ToolParser
from patchbay.interfaces.parsing import tool_call_of

BUNDLED_TOOLS_TEMPLATE = Path(__file__).resolve().parent / "chat_templates" / "smollm2_tools.jinja"
"""The bundled model's chat template with a tools section (renders as the model's own template without tools)."""


class ChatRequestError(ValueError):
    """A chat request patchbay cannot serve; ``param`` is the request field at fault (``tools.0.function``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


# -- tools and tool_choice --------------------------------------------------------------------------------


ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """How a request's calls are obtained."""

    mode: ToolMode
    functions: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each offered function's name -> its parameters' JSON schema."""
    named: str | None = None
    """The function ``tool_choice`` names (mode ``named``)."""
    parallel: bool = True

    @property
    def enforced(self) -> bool:
        """Calls come from a JSON-schema constraint, not from a parser."""
        return self.mode in ("required", "named")

    def constraint(self, *, compact: bool = True) -> dict[str, Any] | None:
        """The ``structured_output`` constraint that enforces the calls (``None`` unless enforced); ``compact``
        asks the backend for JSON without whitespace outside strings, so no ``max_tokens`` go on indentation."""
        if self.mode == "named":
            constraint: dict[str, Any] = {"json_schema": self.functions[self.named]}  # type: ignore[index]
        elif self.mode == "required":
            constraint = {"json_schema": calls_schema(self.functions, parallel=self.parallel)}
        else:
            return None
        if compact:
            constraint["json_whitespace"] = "compact"
        return constraint

    def enforced_calls(self, text: str) -> EnforcedCalls:
        """The calls of an enforced answer (the constraint's JSON), the whole answer or the start of one cut
        short: every call it completed, and whether the JSON itself is complete."""
        if self.mode == "named":
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return EnforcedCalls((), complete=False)
            if not isinstance(value, dict):
                return EnforcedCalls((), complete=False)
            return EnforcedCalls((ToolCall(self.named, json.dumps(value, ensure_ascii=False)),), complete=True)  # type: ignore[arg-type]
        return _calls_of_array(text)


@dataclass(frozen=True)
class EnforcedCalls:
    """What an enforced answer holds: the calls it completed, and whether its JSON ended (not cut short)."""

    calls: tuple[ToolCall, ...]
    complete: bool


_JSON = json.JSONDecoder()


def _calls_of_array(text: str) -> EnforcedCalls:
    """The complete calls of a JSON array of calls that may be cut short: ``[{"name":"a","arguments":{}},{"na``
    holds one complete call."""
    calls: list[ToolCall] = []
    at = _skip_space(text, 0)
    if not text.startswith("[", at):
        return EnforcedCalls((), complete=False)
    at = _skip_space(text, at + 1)
    if text.startswith("]", at):
        return EnforcedCalls((), complete=not text[at + 1 :].strip())
    while True:
        try:
            item, at = _JSON.raw_decode(text, at)
        except json.JSONDecodeError:
            return EnforcedCalls(tuple(calls), complete=False)  # cut inside this item
        call = tool_call_of(item)
        if call is None:
            return EnforcedCalls(tuple(calls), complete=False)
        calls.append(call)
        at = _skip_space(text, at)
        if text.startswith(",", at):
            at = _skip_space(text, at + 1)
        elif text.startswith("]", at):
            return EnforcedCalls(tuple(calls), complete=not text[at + 1 :].strip())
        else:
            return EnforcedCalls(tuple(calls), complete=False)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def calls_schema(functions: dict[str, dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    """A JSON schema of a list of calls ``[{"name": ..., "arguments": {...}}]`` to the given functions."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": options[0] if len(options) == 1 else {"anyOf": options},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


NO_PARAMETERS = {"type": "object", "properties": {}}


def plan_tools(
    tools: Sequence[Any] | None, tool_choice: Any = None, parallel_tool_calls: bool | None = None
) -> ToolPlan:
    """Check the OpenAI tool fields and decide how calls are obtained (see the module docstring)."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ChatRequestError("tools", f"must be a list of tools, got {type(tools).__name__}")
    functions: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools or ()):
        where = f"tools.{index}"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ChatRequestError(f"{where}.type", "only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ChatRequestError(f"{where}.function", "a function object with a name is required")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatRequestError(f"{where}.function.name", "a non-empty string is required")
        if name in functions:
            raise ChatRequestError(f"{where}.function.name", f"{name!r} is offered twice")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ChatRequestError(f"{where}.function.parameters", "must be a JSON schema object")
        functions[name] = parameters
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        return ToolPlan("auto" if functions else "none", functions, parallel=parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ChatRequestError(
                "tool_choice",
                f"{tool_choice!r} is not one of none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
            )
        if tool_choice != "none" and not functions:
            raise ChatRequestError("tool_choice", f"{tool_choice!r} needs tools")
        return ToolPlan(tool_choice, functions, parallel=parallel)  # type: ignore[arg-type]
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(named, str):
        raise ChatRequestError("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    if named not in functions:
        offered = ", ".join(functions) or "none"
        raise ChatRequestError("tool_choice.function.name", f"{named!r} is not among the tools (offered: {offered})")
    return ToolPlan("named", functions, named=named, parallel=parallel)


def parameters_path(plan: ToolPlan, name: str) -> str:
    """The request field of a function's parameters (``tools.2.function.parameters``), for errors."""
    return f"tools.{list(plan.functions).index(name)}.function.parameters"


# -- the conversation ---------------------------------------------------------------------------------------


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates take them, checked.

    An assistant message's ``tool_calls`` get their ``arguments`` decoded
    (templates write them as JSON); a ``tool`` message must carry the
    ``tool_call_id`` of a call an earlier assistant message made.
    """
    call_ids: set[str] = set()
    found = []
    for index, message in enumerate(messages):
        message = dict(message)
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls") is not None:
            message["tool_calls"] = [
                _template_call(call, f"messages.{index}.tool_calls.{number}", call_ids)
                for number, call in enumerate(_as_list(message["tool_calls"], index))
            ]
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ChatRequestError(
                    f"messages.{index}.tool_call_id", "a tool message needs the id of the call it answers"
                )
            if call_id not in call_ids:
                known = ", ".join(sorted(call_ids)) or "none"
                raise ChatRequestError(
                    f"messages.{index}.tool_call_id",
                    f"{call_id!r} answers no call an earlier assistant message made (calls: {known})",
                )
        found.append(message)
    return found


def _as_list(value: Any, index: int) -> list[Any]:
    if not isinstance(value, list):
        raise ChatRequestError(f"messages.{index}.tool_calls", f"must be a list, got {type(value).__name__}")
    return value


def _template_call(call: Any, where: str, call_ids: set[str]) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatRequestError(f"{where}.function", "a call needs a function with a name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ChatRequestError(f"{where}.function.arguments", f"not valid JSON: {exc}") from None
    if isinstance(call.get("id"), str):
        call_ids.add(call["id"])
    return {**call, "function": {**function, "arguments": arguments}}


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None, template: str | None
) -> tuple[str, list[int]]:
    """The prompt text and token ids of a conversation (and tools) through ``template`` or the tokenizer's."""
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ChatRequestError("messages", "this model's tokenizer has no chat template; set chat.template")
    if tools and "tools" not in (template or tokenizer.chat_template):
        raise ChatRequestError("tools", "the chat template renders no tools; set chat.template to a template that does")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=list(tools) if tools else None,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as exc:  # the template rejects the conversation (roles out of order, a missing key)
        raise ChatRequestError("messages", f"the chat template failed: {exc}") from None
    return text, tokenizer.encode(text, add_special_tokens=False)


def chat_template_of(path: Path | None, *, bundled_model: bool) -> str | None:
    """The template text a run uses: ``chat.template``'s file, the bundled tools template, or ``None`` (the
    tokenizer's)."""
    if path is not None:
        return Path(path).read_text()
    return BUNDLED_TOOLS_TEMPLATE.read_text() if bundled_model else None


# -- reading answers -----------------------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class IdentifiedCall:
    """A call with the id the client will answer it by."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ChatAnswer:
    """An answer read whole."""

    content: str | None
    reasoning: str | None
    tool_calls: tuple[IdentifiedCall, ...] = ()


@dataclass(frozen=True)
class CallPiece:
    """A piece of a streamed call, in OpenAI's delta shape (``id`` and ``name`` in its first piece only)."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        piece: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            piece.update(id=self.id, type="function")
            function["name"] = self.name
        return {**piece, "function": function}


@dataclass(frozen=True)
class AnswerDelta:
    """What a streamed piece adds."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[CallPiece, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class AnswerReader:
    """Reads answers for one request: reasoning first (if a reasoning parser is set), then calls (by the tool
    parser in mode ``auto``, as the constraint's JSON when enforced), the rest is content."""

    def __init__(
        self, plan: ToolPlan, tool_parser: ToolParser | None, reasoning_parser: ReasoningParser | None
    ) -> None:
        self.plan = plan
        self.tool_parser = tool_parser if plan.mode == "auto" else None
        self.reasoning_parser = reasoning_parser

    def read(self, text: str) -> ChatAnswer:
        reasoning = None
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.parse(text)
            reasoning, text = split.reasoning, split.content
        calls: Sequence[ToolCall] = ()
        if self.plan.enforced:
            calls, content = self.plan.enforced_calls(text).calls, ""  # the answer is the calls' JSON, never content
        elif self.tool_parser is not None:
            parsed = self.tool_parser.parse(text)
            content, calls = parsed.content, parsed.tool_calls
        else:
            content = text
        identified = tuple(IdentifiedCall(new_call_id(), call.name, call.arguments) for call in calls)
        return ChatAnswer(_content_or_none(content, bool(identified)), reasoning, identified)

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


def _content_or_none(content: str, has_calls: bool) -> str | None:
    """OpenAI's ``content`` next to calls: ``None`` when the model said nothing but whitespace."""
    return None if has_calls and not content.strip() else content


class AnswerStream:
    """The streamed form of :meth:`AnswerReader.read`: the deltas add up to the whole read.

    Whitespace-only content is held back until visible content follows, and
    dropped if the answer ends with calls, as the whole read drops it.
    """

    def __init__(self, reader: AnswerReader) -> None:
        self._plan = reader.plan
        self._reasoning: ReasoningStream | None = (
            reader.reasoning_parser.stream() if reader.reasoning_parser is not None else None
        )
        self._calls: ToolCallStream | None = reader.tool_parser.stream() if reader.tool_parser is not None else None
        self._enforced_text: list[str] = []
        self._enforced_sent = 0
        """Enforced calls streamed so far (each whole, as soon as the JSON completes it)."""
        self._held_space = ""
        self._sent_content = False
        self._ids: dict[int, str] = {}

    def feed(self, text: str) -> AnswerDelta:
        return self._step(text, final=False)

    def finish(self) -> AnswerDelta:
        return self._step("", final=True)

    def _step(self, text: str, *, final: bool) -> AnswerDelta:
        reasoning = ""
        if self._reasoning is not None:
            delta = self._reasoning.finish() if final else self._reasoning.feed(text)
            reasoning, text = delta.reasoning, delta.content
        pieces: list[CallPiece] = []
        content = ""
        if self._plan.enforced:
            self._enforced_text.append(text)
            if text or final:
                calls = self._plan.enforced_calls("".join(self._enforced_text)).calls
                pieces = [
                    self._piece(index, call.name, call.arguments)
                    for index, call in enumerate(calls)
                    if index >= self._enforced_sent
                ]
                self._enforced_sent = len(calls)
        elif self._calls is not None:
            fed = self._calls.feed(text)
            content = fed.content
            items = list(fed.tool_calls)
            if final:
                last = self._calls.finish()
                content += last.content
                items += last.tool_calls
            pieces = [self._piece(item.index, item.name, item.arguments) for item in items]
        else:
            content = text
        return AnswerDelta(self._visible(content, final), reasoning, tuple(pieces))

    def _piece(self, index: int, name: str | None, arguments: str) -> CallPiece:
        if index in self._ids:
            return CallPiece(index, None, None, arguments)
        self._ids[index] = new_call_id()
        return CallPiece(index, self._ids[index], name, arguments)

    def _visible(self, content: str, final: bool) -> str:
        if self._sent_content or not (self._plan.enforced or self._calls is not None):
            return content
        self._held_space += content
        if self._held_space.strip():
            self._sent_content = True
            content, self._held_space = self._held_space, ""
            return content
        if final and not self._ids:
            content, self._held_space = self._held_space, ""
            return content
        return ""


def check_constraint_compiles(plan: ToolPlan, compile_schema: Any) -> None:
    """Compile the plan's constraint with ``compile_schema(schema)`` (the run's grammar backend); if it fails,
    raise :class:`ChatRequestError` naming the tool whose parameters do not compile."""
    constraint = plan.constraint()
    if constraint is None:
        return
    try:
        compile_schema(constraint["json_schema"])
        return
    except Exception as exc:  # noqa: BLE001 - any refusal of the backend is the request's fault
        failure = exc
    for name, parameters in plan.functions.items():
        if plan.mode == "named" and name != plan.named:
            continue
        try:
            compile_schema(parameters)
        except Exception as exc:  # noqa: BLE001
            raise ChatRequestError(parameters_path(plan, name), f"the tool's schema does not compile: {exc}") from None
    raise ChatRequestError("tools", f"the tools' schemas do not compile together: {failure}")


class ChatParsers:
    """A run's chat pieces resolved once from its ``chat:`` settings: the template and the parsers.

    A request may name other installed parsers; each is built once and kept.
    """

    def __init__(self, settings: Any, registry: Any, *, bundled_model: bool) -> None:
        self._registry = registry
        section = settings.chat
        self.template = chat_template_of(section.template, bundled_model=bundled_model)
        self._built: dict[tuple[str, str], Any] = {}
        self.tool_parser: ToolParser = self._build(
            "tool_parser", section.tool_parser.name, section.tool_parser.options, "chat.tool_parser"
        )
        self.reasoning_parser: ReasoningParser | None = None
        if section.reasoning_parser is not None:
            self.reasoning_parser = self._build(
                "reasoning_parser",
                section.reasoning_parser.name,
                section.reasoning_parser.options,
                "chat.reasoning_parser",
            )

    def _build(self, kind: str, name: str, options: dict[str, Any], where: str) -> Any:
        key = (kind, name)
        if key not in self._built:
            implementation = self._registry.resolve(kind, name)
            self._built[key] = implementation(plugin_options(implementation, options, where=f"{where}.options"))
        return self._built[key]

    def for_request(
        self, tool_parser: str | None, reasoning_parser: str | None
    ) -> tuple[ToolParser, ReasoningParser | None]:
        """The parsers a request uses: the run's, or the installed ones it names (with default options)."""
        found = [self.tool_parser, self.reasoning_parser]
        for index, (kind, name) in enumerate((("tool_parser", tool_parser), ("reasoning_parser", reasoning_parser))):
            if name is None:
                continue
            try:
                found[index] = self._build(kind, name, {}, kind)
            except Exception as exc:  # noqa: BLE001 - an unknown or broken parser fails this request alone
                raise ChatRequestError(kind, str(exc).splitlines()[0]) from None
        return found[0], found[1]  # type: ignore[return-value]
