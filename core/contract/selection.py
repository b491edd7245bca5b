"""Choosing and creating the plugins a run uses, with every reason a choice cannot work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from patchbay.contract.registry import Registry
from patchbay.contract.settings import ConfigError, ConfigProblem, plugin_options
from patchbay.interfaces import AttentionBackend, AttentionConfig, Plugin, ServingConfig


def _reasons(implementation: type[Plugin], configs: Sequence[ServingConfig]) -> list[str]:
    found: list[str] = []
    for config in configs:
        for reason in implementation.validate(config):
            if reason not in found:
                found.append(reason)
    return found


def require_serves(implementation: type[Plugin], reference: str, key: str, configs: Sequence[ServingConfig]) -> None:
    """Raise :class:`ConfigError` naming the plugin and every reason it cannot serve ``configs``."""
    reasons = _reasons(implementation, configs)
    if reasons:
        raise ConfigError([ConfigProblem("<run>", key, "; ".join(reasons), reference)])


def select_attention_backend(
    registry: Registry, name: str, configs: Sequence[AttentionConfig]
) -> tuple[str, type[AttentionBackend]]:
    """The backend called ``name``, or for ``auto`` the highest-priority one that can serve every config.

    Never falls back silently: a named backend that cannot serve the run is
    an error with its reasons, and ``auto`` with no candidate lists the
    reasons of every registered backend.
    """
    if name != "auto":
        # resolve() checked that the class implements the kind's interface.
        backend = cast("type[AttentionBackend]", registry.resolve("attention", name))
        require_serves(backend, f"attention:{name}", "attention.backend", configs)
        return name, backend
    rejected: list[str] = []
    candidates = []
    for registration in registry.registrations("attention"):
        try:
            backend = cast("type[AttentionBackend]", registration.resolve())
        except Exception as exc:  # a broken third-party backend must not hide the others
            rejected.append(f"{registration.name}: {exc}")
            continue
        reasons = _reasons(backend, configs)
        if reasons:
            rejected.append(f"{registration.name}: {'; '.join(reasons)}")
        else:
            candidates.append((backend.capabilities.priority, registration.name, backend))
    if not candidates:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "attention.backend",
                    "auto found no backend that can serve this model: " + " | ".join(rejected),
                )
            ]
        )
    _, chosen_name, chosen = max(candidates, key=lambda item: (item[0], item[1]))
    return chosen_name, chosen


def create(registry: Registry, kind: str, name: str, options: Mapping[str, Any], key: str, **kwargs: Any) -> Any:
    """Instantiate ``kind:name`` with its validated options (errors name ``key``, the options' key path)."""
    implementation: Any = registry.resolve(kind, name)  # each kind's constructor takes its own arguments
    return implementation(plugin_options(implementation, options, where=key), **kwargs)
