"""The JSONL results of ``patchbay run``: written beside the target and swapped into place, never truncated.

Lines go to a file in the target's directory as requests finish: an unnamed
one where the system offers it (``O_TMPFILE``, and linking it to a name
works there), so a job killed outright (SIGKILL, a crash) leaves nothing
behind; else a hidden ``.NAME.<pid>.<random>.partial``, which the next job
on the same target removes once its process is gone.  :meth:`ResultFile.close` gives it a name and
renames it over the target with ``os.replace``, atomic on one filesystem, so
readers see the old file or the new one, whole.  Two jobs writing one path
never interleave lines (the last to finish wins).

A job that stops early (Ctrl-C, SIGTERM, an engine error, a full disk)
keeps the lines it finished, followed by one ``{"error": ...}`` line; it
never replaces a complete earlier result file with those: they go to
``NAME.incomplete`` beside it instead (the target, when there is none, or
the one there is itself a stopped job's).

Every line is whole: a write that fails (a full disk) is cut back to the end
of the last whole line and raises :class:`ResultsNotWritten`, which names
where the results written so far go; the job stops there, and those results
are still renamed into place (a rename takes no new space).
"""

from __future__ import annotations

import json
import os
import secrets
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


INCOMPLETE_SUFFIX = ".incomplete"
"""Where a stopped job's results go when the target holds complete results: ``results.jsonl.incomplete``."""


class ResultFile:
    """One job's results; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.temporary = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial"
        """The name the results take just before their rename into place (where they stay if it fails)."""
        self._descriptor, self._named = _open_beside(path.parent, self.temporary)
        self._size = 0
        """Bytes of whole lines in the file."""
        self.num_written = 0

    def destination(self, *, stopped: bool) -> Path:
        """Where :meth:`close` puts the results: the target, unless the job stopped early and the target holds an
        earlier job's complete results (then ``NAME.incomplete``)."""
        if stopped and holds_complete_results(self.path):
            return self.path.with_name(self.path.name + INCOMPLETE_SUFFIX)
        return self.path

    def write(self, record: dict[str, Any]) -> None:
        """Append one result line, straight to the file (an interrupted job keeps it); see the module docstring."""
        try:
            self._append((json.dumps(record) + "\n").encode())
        except OSError as exc:
            raise ResultsNotWritten(
                f"could not write result {self.num_written + 1} to {self.temporary} "
                f"({exc.strerror or exc}); the {self.num_written} results written before are "
                f"kept whole there, and renamed to {self.destination(stopped=True)} as the job stops"
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

    def close(self, error: str | None = None, *, num_requests: int | None = None) -> Path:
        """Swap the results into place (:meth:`destination`); with ``error``, after a last line recording it and
        what was done.  Returns where they went.

        On a full disk the error line may be left out; the results before it never are.  Raises
        :class:`ResultsNotWritten` naming the file holding them if they cannot be moved into place.
        """
        destination = self.destination(stopped=error is not None)
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
            # A new file is 0600; results get the usual mode of a new file.
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(self._descriptor, 0o666 & ~umask)
            if not self._named:
                try:
                    os.link(f"/proc/self/fd/{self._descriptor}", self.temporary, follow_symlinks=True)
                except OSError as exc:
                    raise ResultsNotWritten(
                        f"could not give the results file of {destination} a name ({exc.strerror or exc}); its "
                        f"{self.num_written} results are lost"
                    ) from exc
        finally:
            os.close(self._descriptor)
        try:
            os.replace(self.temporary, destination)
        except OSError as exc:
            raise ResultsNotWritten(
                f"could not rename the results file {self.temporary} to {destination} "
                f"({exc.strerror or exc}); its {self.num_written} results are kept there"
            ) from exc
        return destination


def _open_beside(folder: Path, name: Path) -> tuple[int, bool]:
    """A new file in ``folder`` to write results to, and whether it is already called ``name``: unnamed
    (``O_TMPFILE``, gone if the process dies) where the system can later give it a name, else ``name``."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile and _can_name_unnamed_files(folder, name):
        return os.open(folder, os.O_WRONLY | tmpfile | getattr(os, "O_CLOEXEC", 0), 0o600), False
    _remove_abandoned(folder, name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    return os.open(name, flags, 0o600), True


def _can_name_unnamed_files(folder: Path, name: Path) -> bool:
    """Whether an ``O_TMPFILE`` file in ``folder`` can be linked to a name (some filesystems and sandboxes refuse
    it): tried on an empty one."""
    probe = name.with_name(name.name + ".probe")
    try:
        descriptor = os.open(folder, os.O_WRONLY | os.O_TMPFILE | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        return False
    try:
        os.link(f"/proc/self/fd/{descriptor}", probe, follow_symlinks=True)
        os.unlink(probe)
        return True
    except OSError:
        return False
    finally:
        os.close(descriptor)


def _remove_abandoned(folder: Path, name: Path) -> None:
    """Remove the named results files of jobs on the same target that died before renaming them (their process,
    whose id the name carries, is gone)."""
    prefix = name.name.split(".partial")[0].rsplit(".", 2)[0]  # ".NAME"
    for stale in folder.glob(f"{prefix}.*.*.partial"):
        pid = stale.name[len(prefix) + 1 :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                stale.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def holds_complete_results(path: Path) -> bool:
    """Whether ``path`` holds a finished job's results: it exists and its last line is not a stopped job's
    ``{"error": ...}`` record (an unreadable file counts as complete: it is not ours to replace)."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - (64 << 10)))
            tail = file.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    lines = [line for line in tail.splitlines() if line.strip()]
    if not lines:
        return True
    try:
        last = json.loads(lines[-1])
    except ValueError:
        return True
    return not (isinstance(last, dict) and set(last) == {"error", "num_results", "num_requests"})
