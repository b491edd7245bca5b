"""pytest plugin of the conformance kit (auto-loaded through the ``pytest11`` entry point).

Provides the ``patchbay_registry`` fixture and turns known gaps declared on
a suite subclass into strict expected failures.
"""

from __future__ import annotations

import pytest

from patchbay.contract.registry import Registry, default_registry
from patchbay.testing.suite import PluginSuite


@pytest.fixture(scope="session")
def patchbay_registry() -> Registry:
    """The registry suites look plugins up in: every installed ``patchbay`` entry point.

    Override this fixture to test a plugin that is not installed (build a
    :class:`~patchbay.contract.registry.Registry` and ``add_plugin`` your hooks).
    """
    return default_registry()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Gaps declared on the suite subclass; those declared on the plugin class are applied by a
    # PluginSuite fixture, since the plugin is only known once the fixtures resolve it.
    for item in items:
        suite = getattr(item, "cls", None)
        if not (isinstance(suite, type) and issubclass(suite, PluginSuite)):
            continue
        reason = suite.known_gaps.get(getattr(item, "originalname", item.name))
        if reason:
            item.add_marker(pytest.mark.xfail(reason=f"known gap: {reason}", strict=True))
