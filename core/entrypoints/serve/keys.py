"""The API keys the server accepts: ``server.api_keys`` and the lines of ``server.api_key_file``.

A key on the command line (``--set server.api_keys=...``) is readable by
every local user through ``ps``; the environment
(``PATCHBAY_SERVER__API_KEYS``) or a key file readable by its owner alone
keeps it private.  The file holds one key per line (blank lines and lines
starting with ``#`` are skipped) and is refused when others may read it.
"""

from __future__ import annotations

import os
import stat

from patchbay.contract.settings import ConfigError, ConfigProblem, ServerSettings


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
