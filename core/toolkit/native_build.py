"""Building patchbay's C++ extensions once per installation and CPU, and loading them without waiting.

Each extension (:class:`NativeExtension`) is compiled from real ``.cpp``
files, shipped as package data in a ``csrc/`` folder beside the Python that
loads them (:data:`CSRC` holds the toolkit's kernels and the headers every
extension may include), with ``torch.utils.cpp_extension`` (a C++ compiler
and ``ninja`` are needed) into patchbay's cache directory, in a folder named
by a hash of its sources and every header it may include, the compiler
flags, the torch version, the torch installation and the CPU's model and
flags: ``-march=native`` code built on one CPU may not run on another
sharing the cache directory, and two virtual environments never rebuild each
other's copy.  ``make`` builds them at install time; elsewhere
:class:`BackgroundBuild` builds one in a thread while the code that needs it
uses its plain torch path.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

__all__ = ["BackgroundBuild", "CSRC", "NATIVE_CFLAGS", "NativeExtension", "build_at_install", "build_unavailable"]

logger = logging.getLogger(__name__)

STALE_LOCK_SECONDS = 600.0
"""A build lock older than this was left by a process killed mid-build (a build takes well under a minute)."""

BUILDER_FILE = "builder"
"""The file in a build folder naming the host and process id of the last process that started a build there."""

NATIVE_CFLAGS = ("-O3", "-march=native", "-fopenmp")
"""Flags every extension is compiled with (an extension may add its own)."""


CSRC = Path(__file__).resolve().parent / "csrc"
"""The C++ sources of the worker's kernels and the headers every extension may include (``simd.h``: a float
register type over AVX-512 or AVX2 with float32 and bfloat16 loads and stores and a vectorized exponential)."""


@functools.cache
def build_unavailable() -> str | None:
    """Why no extension can be built here (``None`` when they can)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) on PATH to build the kernel"
    if importlib.util.find_spec("ninja") is None:
        return "the ninja package is not installed (torch builds C++ extensions with it)"
    return None


@dataclass(frozen=True)
class NativeExtension:
    """One C++ extension: its name prefix, ``.cpp`` sources (which bind their own functions), compiler flags and
    the folders its ``#include "..."`` lines search."""

    prefix: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...] = NATIVE_CFLAGS
    include_dirs: tuple[Path, ...] = (CSRC,)

    def inputs(self) -> list[Path]:
        """Every file the build reads from patchbay: the sources, then each header (``*.h``) in the include
        folders and beside the sources, in name order."""
        folders = dict.fromkeys([*self.include_dirs, *(source.parent for source in self.sources)])
        headers = sorted({header for folder in folders for header in Path(folder).glob("*.h")})
        return [*self.sources, *headers]

    def build_name(self) -> str:
        """The module's name: the prefix and a hash of what the built code depends on (every source and header,
        the flags, torch and the CPU)."""
        import torch

        from patchbay.toolkit.cpu import CpuInfo

        missing = [str(path) for path in self.inputs() if not path.is_file()]
        if missing:
            raise RuntimeError(
                f"cannot build {self.prefix}: its C++ source {', '.join(missing)} is missing "
                "(an installation without patchbay's package data; reinstall patchbay)"
            )
        cpu = CpuInfo.read()
        digest = hashlib.sha256()
        for path in self.inputs():
            digest.update(f"{path.name}\0".encode())
            digest.update(path.read_bytes())
            digest.update(b"\0")
        key = "\0".join(
            [
                digest.hexdigest(),
                *self.cflags,
                torch.__version__,
                str(Path(torch.__file__).parent),
                cpu.model_name,
                *sorted(cpu.flags),
            ]
        )
        return f"{self.prefix}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"

    def build_directory(self) -> Path:
        """Where this installation builds it: patchbay's cache directory, one folder per :meth:`build_name`."""
        from patchbay.toolkit.paths import cache_dir

        return cache_dir() / "kernels" / f"py{sys.version_info.major}{sys.version_info.minor}" / self.build_name()

    def without_avx512(self) -> NativeExtension:
        """The same extension built without AVX-512 (its AVX2 path, where the CPU has AVX2): for tests of the
        path CPUs without AVX-512 run, on a CPU that has both."""
        return dataclasses.replace(self, cflags=(*self.cflags, "-mno-avx512f"))

    def is_built(self) -> bool:
        """Whether :meth:`load` would import the module without compiling it (nor waiting for a build)."""
        if build_unavailable() is not None:
            return False
        directory = self.build_directory()
        return finished(directory / f"{self.build_name()}.so", directory / "lock")

    def load(self) -> Any:
        """The built module: imported if built already, else built now (waiting for another process's build)."""
        reason = build_unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot build {self.prefix}: {reason}")
        directory = self.build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        built = directory / f"{self.build_name()}.so"
        lock = directory / "lock"
        # Built already (the folder's name pins source, flags, torch and CPU): import it without torch's builder,
        # which takes its lock even to find nothing to do, so a process killed at that moment (a rank a test or
        # an operator kills) left a lock every later start waited on for ever.
        if finished(built, lock):
            return import_built(built)
        wait_for_other_builds(directory)
        clear_stale_lock(directory)
        if finished(built, lock):
            return import_built(built)
        (directory / BUILDER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")
        from torch.utils.cpp_extension import load

        return load(
            name=self.build_name(),
            sources=[str(source) for source in self.sources],
            extra_cflags=list(self.cflags),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(folder) for folder in self.include_dirs],
            build_directory=str(directory),
            verbose=False,
        )


def clear_stale_lock(directory: Path) -> None:
    """Remove ``directory``'s build lock if its builder died: it is older than :data:`STALE_LOCK_SECONDS`, or
    the process that took it (on this machine) no longer runs."""
    # torch's builder holds a lock file in the build folder while it compiles; a process killed mid-build
    # leaves it behind, and every later build would wait on it forever.
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS or builder_gone(directory):
        logger.warning("removing the build lock %s, left %.0f s ago by a build that never finished", lock, age)
        lock.unlink(missing_ok=True)


def builder_gone(directory: Path) -> bool:
    """Whether the process that last started a build in ``directory`` ran on this machine and has exited (a
    process that exits during a background build, or is killed mid-build, leaves torch's lock behind)."""
    try:
        host, pid = (directory / BUILDER_FILE).read_text().split()
        if host != socket.gethostname():
            return False  # a cache folder shared between machines: only the lock's age tells
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):
        return False
    return False


def finished(built: Path, lock: Path) -> bool:
    """Whether the library is complete: it exists and no build lock was taken before it was written (a lock
    taken after it is a builder checking that nothing needs doing, or one killed while it checked)."""
    try:
        written = built.stat().st_mtime
    except FileNotFoundError:
        return False
    try:
        return lock.stat().st_mtime >= written
    except FileNotFoundError:
        return True


def wait_for_other_builds(directory: Path) -> None:
    """Wait while another process holds the folder's build lock, until it is released or found stale."""
    lock = directory / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS or builder_gone(directory):
            return
        time.sleep(0.2)


def import_built(path: Path) -> Any:
    """Import the extension module at ``path``."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BackgroundBuild:
    """``load()`` in a background thread, so a fresh install's first requests never wait on a compiler.

    :meth:`ready` returns the module once built and ``None`` until then (and
    for good if the build failed: :attr:`error` says why, logged once).
    A subclass whose ``__init__`` takes no arguments has one shared build per
    process, :meth:`shared`.
    """

    _shared_lock = threading.Lock()
    _instance: ClassVar[BackgroundBuild]
    """A subclass's shared build, set in its own class by :meth:`shared`."""

    def __init__(self, load: Callable[[], Any], what: str) -> None:
        """Start building; ``what`` names the extension in the log (``the C++ decode kernel``)."""
        self.kernel: Any = None
        self.error: str | None = None
        self.what = what
        self._load = load
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._build, name=f"patchbay-build {what}", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            self.kernel = self._load()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("%s could not be built (its torch path keeps serving): %s", self.what, self.error)
        finally:
            self._done.set()

    def ready(self) -> Any:
        """The module if it is built, else ``None`` (never waits)."""
        return self.kernel if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> Any:
        """The module once the build ends (``None`` if it failed or ``timeout`` passed first)."""
        self._done.wait(timeout)
        return self.ready()

    @classmethod
    def started(cls) -> Any:
        """The shared build if something in this process started it, else ``None`` (starts nothing)."""
        return cls.__dict__.get("_instance")

    @classmethod
    def shared(cls) -> Any:
        """The one build of this subclass in this process, started on first call."""
        with BackgroundBuild._shared_lock:
            found = cls.__dict__.get("_instance")
            if found is None:
                found = cast(Callable[[], BackgroundBuild], cls)()  # only argument-free subclasses share one
                cls._instance = found
            return found


def build_at_install(load: Callable[[], Any], what: str, directory: Callable[[], Path]) -> int:
    """Build ``what`` now and log where (the Makefile runs this at install time, so a fresh install's first
    request never waits on a compiler); exit status 0 also where nothing can be built here."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = build_unavailable()
    if reason is not None:
        logger.info("%s is not built: %s", what, reason)
        return 0
    started = time.perf_counter()
    load()
    logger.info("%s ready in %s (%.1f s)", what, directory(), time.perf_counter() - started)
    return 0
