"""``patchbay chat [MODEL]``: a conversation in the terminal, each answer streamed as it is generated.

A line read at the ``>>>`` prompt is a user message; the conversation so far goes through the run's chat
template (``chat.template``, else the tokenizer's), and the answer streams to the terminal.  ``/clear``
starts over, ``/exit``, ``/quit`` or Ctrl-D leaves, and Ctrl-C stops an answer (what was said of it stays
in the conversation) or, at the prompt, clears the line.  With ``chat.reasoning_parser`` set, the model's
reasoning is shown dimmed before its answer and left out of the conversation.

The engine steps in :class:`~patchbay.engine.AsyncLLM`'s thread; each answer runs on one event loop kept
for the whole chat (a stopped answer's last delta arrives after its turn, and must find the loop open), and
between answers the prompt reads lines with plain :func:`input` (line editing where ``readline`` is
installed).
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from patchbay.contract.registry import registry_for
from patchbay.contract.settings import DEFAULT_MODEL, Settings
from patchbay.engine import AsyncLLM
from patchbay.entrypoints.chat import AnswerReader, ChatParsers, ChatRequestError, plan_tools, render_chat
from patchbay.sampling_params import SamplingParams

PROMPT = ">>> "
DIM, RESET = "\033[2m", "\033[0m"
LEAVE = ("/exit", "/quit", "/bye")


@dataclass(frozen=True)
class ChatOptions:
    """What ``patchbay chat``'s own flags set."""

    system: str | None = None
    """A system message opening every conversation (after ``/clear`` too)."""
    max_tokens: int | None = None
    """Most tokens per answer; ``None``: as many as the context has left."""
    temperature: float = 0.7


class TerminalChat:
    """One conversation with the model of ``llm``, written to ``out``."""

    def __init__(
        self, llm: AsyncLLM, settings: Settings, options: ChatOptions, out: TextIO, runner: asyncio.Runner
    ) -> None:
        self.llm = llm
        self.runner = runner
        self.options = options
        self.out = out
        self.color = out.isatty()
        parsers = ChatParsers(
            settings, registry_for(settings.plugins), bundled_model=settings.model.path == DEFAULT_MODEL
        )
        self.template = parsers.template
        self.reader = AnswerReader(plan_tools(None), None, parsers.reasoning_parser)
        self.messages: list[dict[str, Any]] = []
        self.clear()

    def clear(self) -> None:
        """Start the conversation over (the system message stays)."""
        self.messages = [{"role": "system", "content": self.options.system}] if self.options.system else []

    def _params(self, prompt_tokens: int) -> SamplingParams:
        room = self.llm.max_model_len - prompt_tokens
        if room < 1:
            raise ChatRequestError("messages", f"the conversation fills the context ({prompt_tokens} tokens); /clear")
        limit = min(self.options.max_tokens, room) if self.options.max_tokens is not None else room
        return SamplingParams(max_tokens=limit, temperature=self.options.temperature)

    def _write(self, text: str, *, dim: bool = False) -> None:
        if text:
            self.out.write(f"{DIM}{text}{RESET}" if dim and self.color else text)
            self.out.flush()

    async def _answer(self, said: list[str]) -> str | None:
        """Stream one answer into ``said`` (its content pieces); the finish reason."""
        text, token_ids = render_chat(self.llm.tokenizer, self.messages, tools=None, template=self.template)
        stream = self.reader.stream()
        finish = None
        async for delta in self.llm.generate(token_ids, self._params(len(token_ids)), prompt=text):
            for choice in delta.choices:
                pieces = [stream.feed(choice.text)]
                if choice.finish_reason is not None:
                    pieces.append(stream.finish())
                    finish = choice.finish_reason
                for piece in pieces:
                    self._write(piece.reasoning, dim=True)
                    self._write(piece.content)
                    said.append(piece.content)
        return finish

    def turn(self, line: str) -> None:
        """Answer one user line (streamed), and keep both in the conversation."""
        self.messages.append({"role": "user", "content": line})
        said: list[str] = []
        try:
            finish = self.runner.run(self._answer(said))
        except KeyboardInterrupt:  # leaving the stream aborted the request
            finish = "abort"
        except ChatRequestError as exc:
            self.messages.pop()
            self.out.write(f"patchbay chat: {exc}\n")
            return
        self.messages.append({"role": "assistant", "content": "".join(said)})
        note = {"length": " [cut: max tokens]", "abort": " [stopped]"}.get(finish or "", "")
        self.out.write(f"{note}\n\n")
        self.out.flush()


def chat_in_terminal(
    settings: Settings, options: ChatOptions, *, read_line: Any = input, out: TextIO = sys.stdout
) -> int:
    """Run the conversation until ``/exit`` or end of input; the exit status of ``patchbay chat``."""
    try:
        import readline  # noqa: F401 - line editing and history for input(), where the platform has it
    except ImportError:
        pass
    from patchbay.entrypoints.serve.app import model_name_of

    out.write(f"patchbay chat: loading {model_name_of(settings)} ...\n")
    out.flush()
    llm = AsyncLLM(settings)
    runner = asyncio.Runner()
    try:
        chat = TerminalChat(llm, settings, options, out, runner)
        out.write("ready: /clear starts over, /exit or Ctrl-D leaves, Ctrl-C stops an answer\n\n")
        out.flush()
        while True:
            try:
                line = read_line(PROMPT)
            except EOFError:
                out.write("\n")
                break
            except KeyboardInterrupt:
                out.write("\n")
                continue
            line = line.strip()
            if not line:
                continue
            if line in LEAVE:
                break
            if line == "/clear":
                chat.clear()
                out.write("(conversation cleared)\n\n")
                continue
            chat.turn(line)
    finally:
        runner.run(llm.shutdown())
        runner.close()
    return 0
