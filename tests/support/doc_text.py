"""Reading the docs' Markdown: fenced blocks and the shell lines they show (for tests in any folder)."""

from __future__ import annotations

import re

from repo_paths import REPO_ROOT

DOCS = REPO_ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(info string, body)`` of every fenced code block."""
    return [(match.group(1).strip(), match.group(2)) for match in FENCE.finditer(text)]


def shell_lines(text: str) -> list[str]:
    """The lines of sh/bash/console blocks (without a trailing shell comment) and lines after a ``$ `` prompt
    in any block: the command lines the text shows, whatever they run."""
    lines: list[str] = []
    for info, body in fenced_blocks(text):
        language = info.split()[0] if info else ""
        for line in body.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                lines.append(line[2:])
            elif language in ("sh", "bash", "shell", "console"):
                lines.append(re.sub(r"\s+#.*$", "", line))
    return lines
