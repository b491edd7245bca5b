"""pytest plugin of the conformance kit (auto-loaded through the ``pytest11`` entry point).

Provides the ``patchbay_registry`` fixture, turns known gaps declared on
a suite subclass into strict expected failures, and adds ``--patchbay-strict``:
a conformance test that skips for any reason other than a limit the plugin
declares (:func:`patchbay.testing.suite.skip_not_declared`) fails instead.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
from pluggy import Result

from patchbay.contract.registry import Registry, default_registry
from patchbay.testing.suite import NotDeclared, PluginSuite


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--patchbay-strict",
        action="store_true",
        default=False,
        help="fail conformance tests that skip for a reason other than a limit the plugin declares "
        "(unavailable here, unreachable store, missing test context)",
    )


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


def _is_suite_item(item: pytest.Item) -> bool:
    suite = getattr(item, "cls", None)
    return isinstance(suite, type) and issubclass(suite, PluginSuite)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, Result[pytest.TestReport], None]:
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and item.config.getoption("patchbay_strict", False) and _is_suite_item(item)):
        return
    if hasattr(report, "wasxfail") or call.excinfo is None or isinstance(call.excinfo.value, NotDeclared):
        return
    reason = str(call.excinfo.value) or "no reason given"
    report.outcome = "failed"
    report.longrepr = f"strict mode: a skip of a behavioural check is a failure: {reason}"
