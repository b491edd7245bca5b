"""Secrets kept out of what patchbay prints: passwords in URLs and values of secret-named keys."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SECRET_WORDS = {"password", "passwd", "pass", "secret", "token", "key", "auth", "credential"}
"""A key (or URL query parameter) holds a secret when its last ``_``/``-`` separated word is one of these or
its plural (``auth_key``, ``api_keys``, ``password``, ``api_token``; not ``max_num_batched_tokens``, whose
tokens are counted, nor ``key_prefix``); a trailing ``_file`` or ``_path`` is read past (``auth_key_file``)."""
COUNTED_WORDS = {"tokens"}
"""Plurals that name counts rather than secrets (``max_tokens``, ``max_num_batched_tokens``)."""
NOT_SECRET = {"key_prefix"}
HIDDEN = "***"


def is_secret_name(name: str) -> bool:
    name = name.lower()
    if name in NOT_SECRET:
        return False
    words = name.replace("-", "_").split("_")
    if len(words) > 1 and words[-1] in {"file", "path"}:
        words = words[:-1]  # where a secret is kept (``auth_key_file``) is named like the secret
    return _is_secret_word(words[-1]) or any(
        word.removesuffix("s") in {"password", "passwd", "secret"} for word in words
    )


def _is_secret_word(word: str) -> bool:
    if word in SECRET_WORDS:
        return True
    return word not in COUNTED_WORDS and word.endswith("s") and word[:-1] in SECRET_WORDS


def redact_url(url: str) -> str:
    """``url`` with its password (``user:pass@host``) and secret query parameters (``?password=``) hidden."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "<unparsable url>"
    if parts.password is not None:
        netloc = f"{parts.username or ''}:{HIDDEN}@{parts.hostname or ''}" + (f":{port}" if port else "")
        parts = parts._replace(netloc=netloc)
    if parts.query:
        query = [
            (name, HIDDEN if is_secret_name(name) else value)
            for name, value in parse_qsl(parts.query, keep_blank_values=True)
        ]
        parts = parts._replace(query=urlencode(query, safe="*"))
    return urlunsplit(parts)


def redact(data: Any) -> Any:
    """A copy of JSON-like ``data`` with secret-named keys' values and URL passwords hidden."""
    if isinstance(data, dict):
        return {
            key: HIDDEN if is_secret_name(str(key)) and value not in (None, "", [], {}) else redact(value)
            for key, value in data.items()
        }
    if isinstance(data, list):
        return [redact(item) for item in data]
    if isinstance(data, str) and "://" in data:
        return redact_url(data)
    return data


def is_secret_path(path: Iterable[str]) -> bool:
    """Whether a key path (``kv_connector.options.auth_key``, ``server.api_keys.0``) leads into a secret."""
    return any(is_secret_name(str(part)) for part in path)


def redact_assignment(key: str, raw: str) -> str:
    """A ``--set key=raw`` flag as it may be printed: the value hidden under a secret key path, URL passwords
    hidden otherwise."""
    if is_secret_path(key.split(".")):
        return f"{key}={HIDDEN}"
    if "://" in raw:
        text = raw.strip()
        # A plain URL shows with its password hidden; a YAML list or mapping holding one is hidden whole.
        shown = redact_url(text) if not any(mark in text for mark in " []{},\"'") else HIDDEN
        return f"{key}={HIDDEN if shown == '<unparsable url>' else shown}"
    return f"{key}={raw}"
