"""Secrets kept out of what patchbay prints: passwords in URLs and values of secret-named keys."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SECRET_WORDS = {"password", "passwd", "pass", "secret", "token", "key", "auth", "credentials"}
"""A key (or URL query parameter) holds a secret when one of its ``_``/``-`` separated words is one of these
(``auth_key``, ``password``, ``api_token``; not ``max_num_batched_tokens`` nor ``key_prefix``)."""
NOT_SECRET = {"key_prefix"}
HIDDEN = "***"


def is_secret_name(name: str) -> bool:
    name = name.lower()
    if name in NOT_SECRET:
        return False
    words = name.replace("-", "_").split("_")
    return words[-1] in SECRET_WORDS or any(word in {"password", "passwd", "secret"} for word in words)


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
        query = [(name, HIDDEN if is_secret_name(name) else value)
                 for name, value in parse_qsl(parts.query, keep_blank_values=True)]
        parts = parts._replace(query=urlencode(query, safe="*"))
    return urlunsplit(parts)


def redact(data: Any) -> Any:
    """A copy of JSON-like ``data`` with secret-named keys' values and URL passwords hidden."""
    if isinstance(data, dict):
        return {key: HIDDEN if is_secret_name(str(key)) and value is not None else redact(value)
                for key, value in data.items()}
    if isinstance(data, list):
        return [redact(item) for item in data]
    if isinstance(data, str) and "://" in data:
        return redact_url(data)
    return data
