"""pytest plugin of the conformance kit (auto-loaded through the ``pytest11`` entry point).

Provides the ``patchbay_registry`` fixture and turns declared known gaps
into strict expected failures.
"""

from __future__ import annotations

import pytest

from patchbay.registry import PluginError, Registry, default_registry
from patchbay.testing.suite import PluginSuite


@pytest.fixture(scope="session")
def patchbay_registry() -> Registry:
    """The registry suites look plugins up in: every installed ``patchbay`` entry point.

    Override this fixture to test a plugin that is not installed (build a
    :class:`~patchbay.registry.Registry` and ``add_plugin`` your hooks).
    """
    return default_registry()


def _declared_gaps(suite: type[PluginSuite]) -> dict[str, str]:
    gaps = dict(suite.known_gaps)
    if suite.plugin_name:
        try:
            plugin_class = default_registry().resolve(suite.kind, suite.plugin_name)
        except PluginError:
            return gaps  # the suite's own fixtures report the lookup failure
        gaps.update(plugin_class.known_gaps)
    return gaps


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        suite = getattr(item, "cls", None)
        if not (isinstance(suite, type) and issubclass(suite, PluginSuite)):
            continue
        reason = _declared_gaps(suite).get(getattr(item, "originalname", item.name))
        if reason:
            item.add_marker(pytest.mark.xfail(reason=f"known gap: {reason}", strict=True))
