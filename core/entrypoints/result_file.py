"""The JSONL results of ``patchbay run``: written beside the target and renamed into place, never truncated.

Lines go to a temporary file in the target's directory (``.NAME.<random>.partial``)
as requests finish; :meth:`ResultFile.close` renames it over the target with
``os.replace``, atomic on one filesystem.  So the previous results stay whole
until a new job has produced its own, two jobs writing one path never
interleave lines (the last to finish wins), and a job that stops early
still leaves the lines it finished, followed by one ``{"error": ...}`` line.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from patchbay.contract.settings import ConfigError, ConfigProblem


def check_output_path(path: Path, source: str) -> None:
    """Raise :class:`ConfigError` (key ``outputs.path``) if results cannot be written to ``path``."""
    def problem(message: str) -> ConfigError:
        return ConfigError([ConfigProblem(source, "outputs.path", message)])

    if path.is_dir():
        raise problem(f"{path} is a directory; give a file path such as {path / 'results.jsonl'}")
    parent = path.parent
    existing = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise problem(f"cannot create {parent}: {existing} is a file")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise problem(f"cannot write under {existing}: permission denied")


class ResultFile:
    """One job's results; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        self.temporary = Path(temporary)
        self._file = os.fdopen(handle, "w")
        self.num_written = 0

    def write(self, record: dict[str, Any]) -> None:
        """Append one result line (flushed, so an interrupted job keeps it)."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.num_written += 1

    def close(self, error: str | None = None, *, num_requests: int | None = None) -> None:
        """Rename the results into place; with ``error``, after a last line recording it and what was done."""
        if error is not None:
            self._file.write(json.dumps({"error": error, "num_results": self.num_written,
                                         "num_requests": num_requests}) + "\n")
        self._file.close()
        # mkstemp makes the file 0600; results get the usual mode of a new file.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.temporary, 0o666 & ~umask)
        os.replace(self.temporary, self.path)
