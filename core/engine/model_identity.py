"""A fingerprint of a model directory's weights, for the identity KV blocks are stored under.

Two checkpoints of one architecture have the same ``config.json``, and often
weight files of the same size; their KV differs, even where they differ in a
single tensor.  So each weight file contributes its name, its size and the
SHA-256 of every byte.  Hashing costs about a second per gigabyte, so a
file's digest is remembered in ``<cache dir>/weights-fingerprints.json``
under its device, inode, size, modification and change times: a later start
pays one ``stat`` per file, and a file rewritten in place (even with its
modification time put back: the change time cannot be) is hashed again.  The
fingerprint does not depend on file times, so copies of one checkpoint on
several machines share entries.  The memo is an optimization only: one that
cannot be read or written (a full disk, a read-only cache) costs a rehash,
never a failed start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from patchbay.toolkit.paths import cache_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
MEMO_FILE_NAME = "weights-fingerprints.json"
MAX_MEMO_ENTRIES = 512
"""Weight files remembered; the oldest entries are dropped beyond this."""

logger = logging.getLogger("patchbay.engine.model_identity")


def weights_fingerprint(model_dir: Path) -> str:
    """Hex digest over every byte of every weight file under ``model_dir`` (see the module docstring)."""
    digest = hashlib.sha256()
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    memo = _read_memo()
    changed = False
    for path in files:
        info = path.stat()
        content, remembered = _file_digest(path, info, memo)
        changed |= not remembered
        digest.update(f"{path.relative_to(model_dir)}\0{info.st_size}\0{content}\0".encode())
    if changed:
        _write_memo(memo)
    return digest.hexdigest()


def _signature(info: os.stat_result) -> list[int]:
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def _file_digest(path: Path, info: os.stat_result, memo: dict[str, dict]) -> tuple[str, bool]:
    """The SHA-256 of ``path``'s bytes, and whether ``memo`` already knew it (it learns it otherwise)."""
    name = str(path.resolve())
    entry = memo.get(name)
    if isinstance(entry, dict) and entry.get("stat") == _signature(info) and isinstance(entry.get("sha256"), str):
        return entry["sha256"], True
    with path.open("rb") as file:
        content = hashlib.file_digest(file, "sha256").hexdigest()
    if _signature(path.stat()) == _signature(info):  # not rewritten while it was read
        memo.pop(name, None)
        memo[name] = {"stat": _signature(info), "sha256": content}
    return content, False


def _memo_path() -> Path:
    return cache_dir() / MEMO_FILE_NAME


def _read_memo() -> dict[str, dict]:
    try:
        memo = json.loads(_memo_path().read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.debug("weights fingerprint memo %s unreadable (%s); weight files are hashed again", _memo_path(), exc)
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_memo(memo: dict[str, dict]) -> None:
    """Replace the memo atomically with its newest :data:`MAX_MEMO_ENTRIES` entries; a failure is logged only."""
    kept = dict(list(memo.items())[-MAX_MEMO_ENTRIES:])
    path = _memo_path()
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(kept, file)
        os.replace(temporary, path)
    except OSError as exc:
        logger.warning(
            "could not save the weights fingerprint memo %s (%s); the next start hashes the weights again", path, exc
        )
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
