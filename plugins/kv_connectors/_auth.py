"""The secret that authenticates stored KV blocks, and per-user directories that only their owner can write.

Every entry carries an HMAC under the store's key (see ``_blocks``), so an
entry written by anyone without the key (another local user who can write
the directory, a process on the network that can write to Redis) is never
loaded.  The key comes from the connector's ``auth_key`` option, from
``auth_key_file``, or by default from a per-user key file under the cache
directory, created on first use with 32 random bytes and mode 0600.  Runners
that share one store (a producer and a consumer, several machines on one
Redis) must share the key: give them the same ``auth_key`` or key file.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from pydantic import BaseModel, SecretStr

from patchbay.toolkit.paths import cache_dir

KEY_FILE_NAME = "kv-connector.key"


class AuthOptions(BaseModel):
    """The authentication options every built-in connector takes."""

    auth_key: SecretStr | None = None
    """The store's secret (never printed).  Every runner sharing the store needs the same one."""
    auth_key_file: Path | None = None
    """A file holding the secret (only its owner may read or write it); default: a per-user key file
    ``<cache dir>/kv-connector.key``, created on first use.  Ignored when ``auth_key`` is set."""


class UnsafeLocation(PermissionError, ValueError):
    """A key file or store directory someone other than this user could have written.

    Also a ``ValueError``: the setting that names the path is at fault, so the
    command line reports it as a one-line error, not a traceback."""


def check_private(path: Path, what: str, *, allow_group_read: bool = True) -> None:
    """Refuse ``path`` unless this user owns it and nobody else may write it (nor read it, for a key)."""
    info = path.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise UnsafeLocation(
            f"{what} {path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}); "
            f"someone else could have put entries or a key there: remove it or choose another path"
        )
    forbidden = stat.S_IWGRP | stat.S_IWOTH | (0 if allow_group_read else stat.S_IRGRP | stat.S_IROTH)
    if info.st_mode & forbidden:
        raise UnsafeLocation(
            f"{what} {path} has mode {stat.filemode(info.st_mode)}: others may "
            f"{'write' if allow_group_read else 'read or write'} it; chmod it to "
            f"{'0700' if path.is_dir() else '0600'}"
        )


def private_directory(path: Path, what: str) -> Path:
    """``path`` created 0700 if missing, then checked to be this user's alone (see :func:`check_private`)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(path, what)
    return path


def _read_or_create_key(path: Path) -> bytes:
    path = path.expanduser()
    if not path.exists():
        private_directory(path.parent, "the directory of the KV connector key file")
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process created it first: read theirs
        else:
            with os.fdopen(descriptor, "w") as file:
                file.write(secrets.token_hex(32) + "\n")
    check_private(path, "the KV connector key file", allow_group_read=False)
    key = path.read_text().strip()
    if len(key) < 16:
        raise UnsafeLocation(f"the KV connector key file {path} holds {len(key)} characters; a key has at least 16")
    return key.encode()


def resolve_key(options: BaseModel) -> bytes:
    """The secret for a connector's ``options`` (see the module docstring)."""
    secret = getattr(options, "auth_key", None)
    if secret is not None:
        value = secret.get_secret_value()
        if len(value) < 16:
            raise ValueError("kv_connector.options.auth_key: a key has at least 16 characters")
        return value.encode()
    key_file = getattr(options, "auth_key_file", None)
    return _read_or_create_key(key_file if key_file is not None else cache_dir() / KEY_FILE_NAME)
