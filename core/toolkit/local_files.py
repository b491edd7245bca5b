"""Reading files a request names, without following a path that changes under us, and without blocking forever.

Two ways in, both refusing anything but a regular file (a FIFO, a device or
a socket would block the read or never end):

- :func:`open_under` walks a path below a trusted folder one component at a
  time, each opened from the folder descriptor before it with ``openat`` and
  ``O_NOFOLLOW``.  A symbolic link met on the way is read (``readlinkat``) and
  its target walked the same way, from the folder it sits in or from the
  trusted folder; ``..`` steps back to the folder walked before, never above
  the trusted one.  So the file opened is the one the walk reached: a link
  swapped in between a check and the open cannot lead the read out of the
  folder, since there is no check-then-open.
- :func:`open_regular_file` opens a path the operator gave (links followed),
  non-blocking, and checks the opened file, not the name.

:func:`read_capped` reads an opened file up to a limit and
:func:`call_with_timeout` bounds the whole read in time.  Failures raise
:class:`LocalFileError` with a reason that names no path outside what the
caller was given, for the caller to phrase.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import TypeVar

__all__ = [
    "MAX_LINKS",
    "LeadsOutside",
    "LocalFileError",
    "MissingFile",
    "call_with_timeout",
    "open_regular_file",
    "open_under",
    "read_capped",
    "relative_parts",
]

_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NON_BLOCKING = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_OPENAT = bool(_NO_FOLLOW) and os.open in os.supports_dir_fd
"""Whether this platform opens a name relative to a folder descriptor without following a final link."""

T = TypeVar("T")


class LocalFileError(OSError):
    """A file that is not read; the message says why without naming the path."""


class MissingFile(LocalFileError, FileNotFoundError):
    """No file (or folder on the way) of that name."""


class LeadsOutside(LocalFileError):
    """A path, or a link on it, that leads out of the trusted folder."""


def relative_parts(path: PurePosixPath, roots: Sequence[Path]) -> tuple[str, ...] | None:
    """``path``'s components below the first of ``roots`` it starts with, compared as written (nothing on disk is
    read); ``None`` if it starts with none of them."""
    for root in roots:
        try:
            return path.relative_to(PurePosixPath(root)).parts
        except ValueError:
            continue
    return None


MAX_LINKS = 40
"""Symbolic links one walk may follow (as the kernel's own limit), so a loop of links ends."""


def open_under(root: Path, parts: Sequence[str], *, roots: Sequence[Path] = ()) -> int:
    """A descriptor of the regular file ``root/parts...``, walked as the module says (an absolute link target is
    taken when it starts with ``root`` or one of ``roots``, its other spellings; anything leading out is refused)."""
    if not _OPENAT:
        raise LocalFileError("this platform cannot open files without following links (no O_NOFOLLOW, openat)")
    pending = list(reversed(parts))
    folders = [os.open(root, _FLAGS | _DIRECTORY)]
    links = 0
    try:
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if len(folders) == 1:
                    raise LeadsOutside("'..' leads out of the folder")
                os.close(folders.pop())
                continue
            last = not pending
            flags = _FLAGS | _NO_FOLLOW | (_NON_BLOCKING if last else _DIRECTORY)
            try:
                descriptor = os.open(name, flags, dir_fd=folders[-1])
            except OSError as exc:
                target = _link_target(name, folders[-1], exc)
                links += 1
                if links > MAX_LINKS:
                    raise LocalFileError(f"more than {MAX_LINKS} symbolic links on the way") from None
                if target.is_absolute():
                    inside = relative_parts(target, [root, *roots])
                    if inside is None:
                        raise LeadsOutside("a symbolic link on the way leads out of the folder") from None
                    while len(folders) > 1:
                        os.close(folders.pop())
                    target = PurePosixPath(*inside) if inside else PurePosixPath(".")
                pending.extend(reversed(target.parts))
                continue
            if last:
                return _regular(descriptor)
            folders.append(descriptor)
        raise LocalFileError("the path names a folder, not a file")
    finally:
        for folder in folders:
            os.close(folder)


def _link_target(name: str, folder: int, exc: OSError) -> PurePosixPath:
    """The target of the link ``name`` in ``folder`` whose ``O_NOFOLLOW`` open failed with ``exc`` (re-raised as
    :class:`LocalFileError` when ``name`` is no link)."""
    try:
        is_link = stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
        if is_link:
            return PurePosixPath(os.readlink(name, dir_fd=folder))
    except OSError:
        pass
    if exc.errno == getattr(os, "ENOTDIR", None):
        raise LocalFileError("a part of the path is not a folder") from None
    if isinstance(exc, FileNotFoundError):
        raise MissingFile("no such file") from None
    raise LocalFileError(exc.strerror or str(exc)) from None


def open_regular_file(path: Path) -> int:
    """A descriptor of the regular file at ``path`` (links followed), opened without blocking on a FIFO."""
    try:
        descriptor = os.open(path, _FLAGS | _NON_BLOCKING)
    except OSError as exc:
        raise LocalFileError(exc.strerror or str(exc)) from None
    return _regular(descriptor)


def _regular(descriptor: int) -> int:
    """``descriptor`` if it is a regular file (closed and refused otherwise), switched back to blocking reads."""
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO, device or socket"
        raise LocalFileError(f"it is {kind}, not a regular file")
    if _NON_BLOCKING:
        os.set_blocking(descriptor, True)
    return descriptor


def read_capped(descriptor: int, max_bytes: int) -> bytes | None:
    """The file's bytes, or ``None`` if it holds more than ``max_bytes``; the descriptor is closed."""
    try:
        with os.fdopen(descriptor, "rb", closefd=True) as file:
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise LocalFileError(exc.strerror or str(exc)) from None
    return None if len(data) > max_bytes else data


def call_with_timeout(function: Callable[[], T], seconds: float) -> T:
    """``function()``, run on a thread of its own; :class:`TimeoutError` if it takes longer than ``seconds`` (the
    thread is left to finish: a read stuck in the kernel cannot be interrupted)."""
    outcome: list[tuple[bool, object]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, function()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome.append((False, exc))
        done.set()

    threading.Thread(target=run, name="patchbay-file-read", daemon=True).start()
    if not done.wait(seconds):
        raise TimeoutError(f"reading took longer than {seconds:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]
