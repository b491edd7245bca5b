"""``patchbay chat``: a conversation in the terminal whose streamed answers are transformers' greedy answers to
the conversation so far, in process and under tmux as a user types it."""

from __future__ import annotations

import io
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from processes import clean_env, patchbay_command
from tiny_models import transformers_greedy

from patchbay.contract.settings import load_settings
from patchbay.entrypoints.interactive_chat import ChatOptions, chat_in_terminal

MAX_TOKENS = 6


def reference_answers(model_dir: Path, user_lines: list[str]) -> list[str]:
    """transformers' greedy answer to each line, the conversation (earlier answers included) rendered by the
    model's chat template; cut at the end-of-sequence token as patchbay stops there."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages: list[dict[str, str]] = []
    answers = []
    for line in user_lines:
        messages.append({"role": "user", "content": line})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        (tokens,) = transformers_greedy(model_dir, [tokenizer.encode(prompt, add_special_tokens=False)], MAX_TOKENS)
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
        answers.append(tokenizer.decode(tokens))
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


class Terminal(io.StringIO):
    """What ``patchbay chat`` writes, with each write kept apart; ``interrupt_at``: raise Ctrl-C on that write."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.interrupt_at = interrupt_at

    def write(self, text: str) -> int:
        self.writes.append(text)
        if self.interrupt_at is not None and len(self.writes) == self.interrupt_at:
            raise KeyboardInterrupt
        return super().write(text)


def feeder(lines: list[str]):
    """A ``read_line`` that returns ``lines`` in turn, then raises EOFError (Ctrl-D)."""
    pending = iter(lines)

    def read_line(prompt: str) -> str:
        line = next(pending, None)
        if line is None:
            raise EOFError
        if line == "^C":
            raise KeyboardInterrupt
        return line

    return read_line


@pytest.fixture(scope="module")
def chat_settings(tiny_llama):
    return load_settings(None, overrides=[f"model.path={tiny_llama}", "model.dtype=float32", "cache.num_blocks=96"])


def test_answers_stream_as_transformers_greedy_answers_to_the_conversation(tiny_llama, chat_settings):
    user_lines = ["Hello there", "And then?"]
    expected = reference_answers(tiny_llama, user_lines)
    out = Terminal()
    options = ChatOptions(max_tokens=MAX_TOKENS, temperature=0.0)
    assert chat_in_terminal(chat_settings, options, read_line=feeder(["", "^C", *user_lines]), out=out) == 0
    text = out.getvalue()
    for answer in expected:
        assert f"{answer}" in text
    first, second = (text.index(answer) for answer in expected)
    assert first < second
    pieces = [w for w in out.writes if w and w in expected[0]]
    assert len(pieces) > 1, "the first answer came in one piece, not streamed"


def test_clear_starts_the_conversation_over(tiny_llama, chat_settings):
    (fresh,) = reference_answers(tiny_llama, ["And then?"])
    in_context = reference_answers(tiny_llama, ["Hello there", "And then?"])[1]
    out = Terminal()
    options = ChatOptions(max_tokens=MAX_TOKENS, temperature=0.0)
    chat_in_terminal(chat_settings, options, read_line=feeder(["Hello there", "/clear", "And then?", "/exit"]), out=out)
    after = out.getvalue().split("(conversation cleared)")[1]
    assert fresh in after
    if in_context not in fresh:
        assert in_context not in after


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(chat_settings):
    out = Terminal(interrupt_at=6)  # banner, ready line, then the answer's pieces
    options = ChatOptions(max_tokens=200, temperature=0.0)
    chat_in_terminal(chat_settings, options, read_line=feeder(["Hello there", "Again"]), out=out)
    text = out.getvalue()
    assert " [stopped]" in text
    assert text.count("\n\n") >= 3  # the second answer ran to its end after the first was stopped


# -- under tmux, as a user types ---------------------------------------------------------------------------


class Tmux:
    """A tmux server of the test's own (its own socket, so it starts with this environment)."""

    def __init__(self, socket_name: str) -> None:
        self.base = ["tmux", "-L", socket_name]

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], capture_output=True, text=True, check=True, timeout=30).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-J", "-S", "-200", "-t", "chat")

    def wait_for(self, condition, timeout: float = 240.0) -> str:  # noqa: ANN001 - a predicate on the screen
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if condition(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"the chat did not get there in {timeout} s; the screen:\n{screen}")
            time.sleep(0.2)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_patchbay_chat_under_tmux(tiny_llama):
    user_lines = ["Hello there", "And then?"]
    expected = reference_answers(tiny_llama, user_lines)
    command = [
        *patchbay_command(),
        "chat",
        str(tiny_llama),
        "--dtype",
        "float32",
        "--max-tokens",
        str(MAX_TOKENS),
        "--temperature",
        "0",
        "--set",
        "cache.num_blocks=96",
    ]
    tmux = Tmux(f"patchbay-test-{os.getpid()}")
    env = clean_env()
    # The shell a user types into: it runs the chat and says how it ended.
    session = f"{shlex.join(command)}; echo patchbay chat exited with $?; sleep 600"
    subprocess.run(
        [*tmux.base, "new-session", "-d", "-s", "chat", "-x", "200", "-y", "50", session],
        check=True,
        env=env,
        timeout=30,
    )
    try:
        tmux.wait_for(lambda screen: "ready:" in screen and ">>>" in screen)
        for number, line in enumerate(user_lines, start=1):
            tmux("send-keys", "-t", "chat", line, "Enter")
            tmux.wait_for(lambda screen, n=number: screen.count(">>>") == n + 1)
        screen = tmux.screen()
        tmux("send-keys", "-t", "chat", "/exit", "Enter")
        tmux.wait_for(lambda screen: "patchbay chat exited with 0" in screen, timeout=120)
    finally:
        subprocess.run([*tmux.base, "kill-server"], capture_output=True, timeout=30)
    joined = "".join(screen.split())
    for line, answer in zip(user_lines, expected, strict=True):
        assert f">>>{''.join(line.split())}{''.join(answer.split())}" in joined, (answer, screen)
