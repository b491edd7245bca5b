"""Choosing and creating the plugins a run uses, with every reason a choice cannot work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from patchbay.contract.registry import Registry
from patchbay.contract.settings import ConfigError, ConfigProblem, plugin_options
from patchbay.interfaces import (
    Architecture,
    ArchitectureConfig,
    AttentionBackend,
    AttentionConfig,
    Plugin,
    ServingConfig,
)


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
        require_serves(backend, f"attention:{name}", "attention.name", configs)
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
                    "attention.name",
                    "auto found no backend that can serve this model: " + " | ".join(rejected),
                )
            ]
        )
    _, chosen_name, chosen = max(candidates, key=lambda item: (item[0], item[1]))
    return chosen_name, chosen


def select_architecture(registry: Registry, name: str, config: ArchitectureConfig) -> tuple[str, type[Architecture]]:
    """The architecture plugin called ``name``, or for ``auto`` the highest-priority one that serves ``config``
    (ties: the plugin that lists the architecture by name before one that only tries any, then by name).

    A named plugin that cannot serve the model is an error with its reasons; ``auto`` with no candidate lists
    the reasons of every registered plugin.
    """
    key = "model.architecture.name"
    if name != "auto":
        plugin = cast("type[Architecture]", registry.resolve("architecture", name))
        require_serves(plugin, f"architecture:{name}", key, [config])
        return name, plugin
    rejected: list[str] = []
    candidates = []
    for registration in registry.registrations("architecture"):
        try:
            plugin = cast("type[Architecture]", registration.resolve())
        except Exception as exc:  # a broken third-party plugin must not hide the others
            rejected.append(f"{registration.name}: {exc}")
            continue
        reasons = _reasons(plugin, [config])
        if reasons:
            rejected.append(f"{registration.name}: {'; '.join(reasons)}")
            continue
        capabilities = plugin.capabilities
        by_name = config.architecture in capabilities.architectures
        candidates.append((capabilities.priority, by_name, registration.name, plugin))
    if not candidates:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    key,
                    f"auto found no architecture plugin that serves {config.architecture}: " + " | ".join(rejected),
                )
            ]
        )
    *_, chosen_name, chosen = max(candidates, key=lambda item: item[:3])
    return chosen_name, chosen


def create(registry: Registry, kind: str, name: str, options: Mapping[str, Any], key: str, **kwargs: Any) -> Any:
    """Instantiate ``kind:name`` with its validated options (errors name ``key``, the options' key path)."""
    implementation: Any = registry.resolve(kind, name)  # each kind's constructor takes its own arguments
    return implementation(plugin_options(implementation, options, where=key), **kwargs)
