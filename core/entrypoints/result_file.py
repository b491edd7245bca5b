"""The JSONL results of ``patchbay run``: written beside the target and renamed into place, never truncated.

Lines go to a temporary file in the target's directory (``.NAME.<random>.partial``)
as requests finish; :meth:`ResultFile.close` renames it over the target with
``os.replace``, atomic on one filesystem.  So the previous results stay whole
until a new job has produced its own, two jobs writing one path never
interleave lines (the last to finish wins), and a job that stops early
still leaves the lines it finished, followed by one ``{"error": ...}`` line.

Every line is whole: a write that fails (a full disk) is cut back to the end
of the last whole line and raises :class:`ResultsNotWritten`, which names
the file that holds the results written so far; the job stops there, and
those results are still renamed into place (a rename takes no new space).
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


class ResultsNotWritten(RuntimeError):
    """Results could not be written (a full disk, an I/O error); the message names the file holding those kept."""


class ResultFile:
    """One job's results; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        self.temporary = Path(temporary)
        self._descriptor = handle
        self._size = 0
        """Bytes of whole lines in the file."""
        self.num_written = 0

    def write(self, record: dict[str, Any]) -> None:
        """Append one result line, straight to the file (an interrupted job keeps it); see the module docstring."""
        try:
            self._append((json.dumps(record) + "\n").encode())
        except OSError as exc:
            raise ResultsNotWritten(
                f"could not write result {self.num_written + 1} to {self.temporary} "
                f"({exc.strerror or exc}); the {self.num_written} results written before are "
                f"kept whole there, and renamed to {self.path} as the job stops"
            ) from exc
        self.num_written += 1

    def _append(self, line: bytes) -> None:
        """Write ``line`` whole, or cut the file back to its last whole line and re-raise."""
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._descriptor, view) :]
        except OSError:
            os.ftruncate(self._descriptor, self._size)
            os.lseek(self._descriptor, self._size, os.SEEK_SET)
            raise
        self._size += len(line)

    def close(self, error: str | None = None, *, num_requests: int | None = None) -> None:
        """Rename the results into place; with ``error``, after a last line recording it and what was done.

        On a full disk the error line may be left out; the results before it never are.  Raises
        :class:`ResultsNotWritten` naming the temporary file if it cannot be renamed into place.
        """
        try:
            if error is not None:
                try:
                    self._append(
                        (
                            json.dumps({"error": error, "num_results": self.num_written, "num_requests": num_requests})
                            + "\n"
                        ).encode()
                    )
                except OSError:
                    pass  # the whole results matter more than the line saying why they stop
            # mkstemp makes the file 0600; results get the usual mode of a new file.
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(self._descriptor, 0o666 & ~umask)
        finally:
            os.close(self._descriptor)
        try:
            os.replace(self.temporary, self.path)
        except OSError as exc:
            raise ResultsNotWritten(
                f"could not rename the results file {self.temporary} to {self.path} "
                f"({exc.strerror or exc}); its {self.num_written} results are kept there"
            ) from exc
