"""The API keys the server accepts: ``server.api_keys`` and the lines of ``server.api_key_file``.

A key on the command line (``--set server.api_keys=...``) is readable by
every local user through ``ps``; the environment
(``PATCHBAY_SERVER__API_KEYS``) or a key file readable by its owner alone
keeps it private.  The file holds one key per line (blank lines and lines
starting with ``#`` are skipped) and is refused when others may read it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable

from fastapi import Request

from patchbay.contract.settings import ConfigError, ConfigProblem, ServerSettings
from patchbay.entrypoints.serve.protocol import APIError


def _problem(message: str) -> ConfigError:
    return ConfigError([ConfigProblem("server", "server.api_key_file", message)])


def accepted_api_keys(server: ServerSettings) -> set[str]:
    """Every accepted key; raises :class:`ConfigError` naming ``server.api_key_file`` when it cannot be used."""
    keys = {key for key in server.api_keys if key}
    path = server.api_key_file
    if path is None:
        return keys
    try:
        info = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise _problem(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise _problem(f"{path} is not UTF-8 text (one key per line)") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise _problem(f"{path} has mode {stat.filemode(info.st_mode)}: others may read it; chmod it to 0600")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise _problem(f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})")
    from_file = {line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")}
    if not from_file:
        raise _problem(f"{path} holds no key (one key per line)")
    return keys | from_file


def api_key_check(server: ServerSettings) -> Callable[[Request], None]:
    """A route dependency refusing (401) a request without an accepted ``Authorization: Bearer`` key; the keys are
    read now, so a bad ``server.api_key_file`` fails the start."""
    api_keys = accepted_api_keys(server)

    def check_api_key(request: Request) -> None:
        if not api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in api_keys:
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    return check_api_key


def caller_of(request: Request) -> str:
    """Who is calling, for what is kept per API key: a digest of the ``Authorization`` bearer key (``""``
    without one; on a keyless server every caller is the same)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return ""
    return hashlib.sha256(key.strip().encode("utf-8", "surrogatepass")).hexdigest()
