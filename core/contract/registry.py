"""The plugin registry: one generic mechanism serving every plugin kind (:data:`KINDS`).

Plugins are modules exposed under the ``patchbay`` entry-point group (the
built-in ones included).  Loading imports each module on its own and calls
its registration hooks with per-plugin containment: a plugin that fails is
recorded as a :class:`LoadFailure` with its distribution, version and error,
and the others still load.  In strict mode the first failure raises.
Implementations are referenced lazily and imported only by :meth:`Registry.resolve`.
"""

from __future__ import annotations

import importlib
import re
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any

import pluggy

from patchbay.contract import hookspecs
from patchbay.contract.versions import ContractVersionError, check_compatibility
from patchbay.contract.kinds import KINDS, Kind
from patchbay.interfaces import Plugin

ENTRY_POINT_GROUP = "patchbay"
LOCAL_DISTRIBUTION = "<local>"
_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_\-]*$")


class PluginError(Exception):
    """Base class of every registry error."""


class PluginLoadError(PluginError):
    """A plugin failed to load (strict mode) or an implementation failed to resolve."""


class PluginConflictError(PluginError):
    """Two plugins registered the same name for one kind."""


class UnknownPluginError(PluginError, LookupError):
    """A name that no loaded plugin registered; the message lists the available names."""


def kind_of(name: str) -> Kind:
    """The :class:`Kind` called ``name``; the error lists the valid kinds."""
    try:
        return KINDS[name]
    except KeyError:
        raise UnknownPluginError(f"unknown plugin kind {name!r}; kinds are: {', '.join(KINDS)}") from None


def parse_reference(reference: str) -> tuple[Kind, str]:
    """Split ``"KIND:NAME"`` (as in ``patchbay check sampler:standard``) into kind and name."""
    kind_name, sep, name = reference.partition(":")
    if not sep or not name:
        raise UnknownPluginError(f"expected KIND:NAME (kinds: {', '.join(KINDS)}), got {reference!r}")
    return kind_of(kind_name), name


@dataclass(frozen=True)
class Origin:
    """Where a registration came from: the entry point and its distribution."""

    plugin: str
    distribution: str = LOCAL_DISTRIBUTION
    version: str = ""

    def __str__(self) -> str:
        version = f" {self.version}" if self.version else ""
        return f"plugin {self.plugin!r} from {self.distribution}{version}"


@dataclass
class Registration:
    """One implementation: its kind, name, lazy target and origin."""

    kind: Kind
    name: str
    target: str | type
    origin: Origin
    description: str = ""
    _resolved: type[Plugin] | None = field(default=None, repr=False)

    @property
    def reference(self) -> str:
        return f"{self.kind.name}:{self.name}"

    @property
    def target_path(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"

    def resolve(self) -> type[Plugin]:
        """Import the implementation (once) and check it implements the kind's interface."""
        if self._resolved is not None:
            return self._resolved
        target = self.target
        if isinstance(target, str):
            module_name, _, attribute = target.partition(":")
            try:
                obj: Any = importlib.import_module(module_name)
                for part in attribute.split("."):
                    obj = getattr(obj, part)
            except Exception as exc:
                raise PluginLoadError(
                    f"{self.reference} ({self.origin}) could not import {target!r}: {type(exc).__name__}: {exc}"
                ) from exc
            target = obj
        if not (isinstance(target, type) and issubclass(target, self.kind.interface)):
            raise PluginLoadError(
                f"{self.reference} ({self.origin}) points to {target!r}, "
                f"which is not a subclass of {self.kind.interface.__module__}.{self.kind.interface.__name__}"
            )
        try:
            check_compatibility(self.kind.name, target, f"{self.reference} ({self.origin})")
        except ContractVersionError as exc:
            raise PluginLoadError(str(exc)) from exc
        self._resolved = target
        return target


@dataclass(frozen=True)
class LoadFailure:
    """A plugin that could not be loaded or whose registration hook failed."""

    origin: Origin
    error: str
    """One line: exception type and message."""
    traceback_summary: str
    """The last frames of the traceback, for the ``patchbay plugins`` report."""

    def __str__(self) -> str:
        return f"{self.origin}: {self.error}"


@dataclass(frozen=True)
class Conflict:
    """Two origins registered one name of one kind; the name is unusable until one is denied."""

    kind: Kind
    name: str
    first: Origin
    second: Origin

    def __str__(self) -> str:
        return (
            f"{self.kind.name}:{self.name} is registered twice: by {self.first} and by {self.second}; "
            f"deny one of them (plugins.deny or PATCHBAY_PLUGINS__DENY)"
        )


@dataclass(frozen=True)
class Exclusion:
    """A plugin (``origin``) or one implementation (``reference``) the plugin policy kept out of the registry."""

    what: str
    """``plugin 'x' from dist 1.0`` or ``KIND:NAME``."""
    rule: str
    """``denied by plugins.deny`` or ``not in plugins.allow``."""
    reference: str | None = None

    def __str__(self) -> str:
        return f"{self.what} is {self.rule} ({POLICY_SOURCES})"


POLICY_SOURCES = "the plugins: section of the settings, or PATCHBAY_PLUGINS__ALLOW / PATCHBAY_PLUGINS__DENY"
"""Where an allow or deny rule can come from, for messages about it."""


def _summarise(exc: BaseException, frames: int = 3) -> tuple[str, str]:
    error = f"{type(exc).__name__}: {exc}"
    summary = traceback.extract_tb(exc.__traceback__)[-frames:]
    lines = [f"{frame.filename}:{frame.lineno} in {frame.name}" for frame in summary]
    return error, "\n".join(lines)


class Registry:
    """Every registered implementation of every kind, loaded from entry points or added by hand.

    ``allow`` and ``deny`` hold names of plugins (entry-point names),
    distributions, or single implementations (``KIND:NAME``).  A non-empty
    ``allow`` admits only what it names; ``deny`` always wins.  Denied plugin
    modules are not imported at all.
    """

    def __init__(self, *, strict: bool = False, allow: Iterable[str] = (), deny: Iterable[str] = ()) -> None:
        self.strict = strict
        self.allow = frozenset(allow)
        self.deny = frozenset(deny)
        self.failures: list[LoadFailure] = []
        self._claims: dict[tuple[str, str], list[Registration]] = {}
        """Every registration of each (kind, name); a name with two or more claimants is a conflict."""
        self._manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._manager.add_hookspecs(hookspecs)
        self._origins: dict[str, Origin] = {}
        self.excluded: list[Exclusion] = []
        """Plugins and implementations the allow/deny policy kept out, so a lookup can say why a name is missing."""

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def from_entry_points(
        cls,
        *,
        strict: bool = False,
        allow: Iterable[str] = (),
        deny: Iterable[str] = (),
        entry_points: Iterable[importlib_metadata.EntryPoint] | None = None,
    ) -> Registry:
        """Load every plugin of the ``patchbay`` entry-point group (or the given entry points)."""
        registry = cls(strict=strict, allow=allow, deny=deny)
        if entry_points is None:
            entry_points = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
        for entry_point in sorted(entry_points, key=lambda ep: ep.name):
            registry._load_entry_point(entry_point)
        try:
            registry._manager.check_pending()
        except pluggy.PluginValidationError as exc:  # a backstop: add_plugin already reports unknown hooks
            if strict:
                raise PluginLoadError(str(exc)) from exc
        return registry

    def _load_entry_point(self, entry_point: importlib_metadata.EntryPoint) -> None:
        dist = getattr(entry_point, "dist", None)
        origin = Origin(
            plugin=entry_point.name,
            distribution=dist.name if dist is not None else LOCAL_DISTRIBUTION,
            version=dist.version if dist is not None else "",
        )
        if not self._admits_plugin(origin):
            return
        if origin.plugin in self._origins:
            self._fail(
                origin,
                PluginConflictError(
                    f"entry point name {origin.plugin!r} is also used by {self._origins[origin.plugin]}; "
                    "entry-point names in the 'patchbay' group must be unique"
                ),
            )
            return
        try:
            module = entry_point.load()
        except Exception as exc:
            self._fail(origin, exc)
            return
        self.add_plugin(module, name=origin.plugin, distribution=origin.distribution, version=origin.version)

    def add_plugin(
        self, plugin: object, *, name: str, distribution: str = LOCAL_DISTRIBUTION, version: str = ""
    ) -> None:
        """Register a module or object of hook implementations and run its registration hooks.

        This is what entry-point loading does for each plugin; tests use it to
        add a plugin object for the duration of a test (see :meth:`remove_plugin`).
        """
        origin = Origin(name, distribution, version)
        if not self._admits_plugin(origin):
            return
        if origin.plugin in self._origins:
            raise PluginConflictError(
                f"a plugin named {origin.plugin!r} is already loaded ({self._origins[origin.plugin]})"
            )
        try:
            self._manager.register(plugin, name=origin.plugin)
            self._reject_unknown_hooks(plugin)
        except Exception as exc:
            if self._manager.get_plugin(origin.plugin) is not None:
                self._manager.unregister(name=origin.plugin)
            self._fail(origin, exc)
            return
        self._origins[origin.plugin] = origin
        for kind in KINDS.values():
            for impl in getattr(self._manager.hook, kind.hook).get_hookimpls():
                if impl.plugin_name != origin.plugin:
                    continue
                try:
                    impl.function(register=self._register_callback(kind, origin))
                except Exception as exc:
                    self._forget(origin.plugin)
                    self._fail(origin, exc)
                    return

    def _reject_unknown_hooks(self, plugin: object) -> None:
        # pluggy accepts implementations of hooks it has no spec for; a misspelled hook would silently do nothing.
        for caller in self._manager.get_hookcallers(plugin) or []:
            if caller.spec is None and any(not impl.optionalhook for impl in caller.get_hookimpls()):
                raise pluggy.PluginValidationError(
                    plugin,
                    f"implements unknown hook {caller.name!r}; known hooks: "
                    + ", ".join(kind.hook for kind in KINDS.values()),
                )

    def remove_plugin(self, name: str) -> None:
        """Unregister a plugin added with :meth:`add_plugin` and drop its registrations."""
        self._forget(name)

    def _forget(self, plugin: str) -> None:
        self._origins.pop(plugin, None)
        if self._manager.get_plugin(plugin) is not None:
            self._manager.unregister(name=plugin)
        for key, claims in list(self._claims.items()):
            claims[:] = [claim for claim in claims if claim.origin.plugin != plugin]
            if not claims:
                del self._claims[key]

    def _register_callback(self, kind: Kind, origin: Origin) -> hookspecs.RegisterCallback:
        def register(name: str, target: str | type, *, description: str = "") -> None:
            self._record(Registration(kind, name, target, origin, description))

        return register

    def _record(self, registration: Registration) -> None:
        kind, name, origin = registration.kind, registration.name, registration.origin
        if not isinstance(name, str) or not _NAME_PATTERN.match(name):
            raise PluginError(
                f"{origin} registered an invalid {kind.name} name {name!r} (use lowercase letters, digits, '_' and '-')"
            )
        if not isinstance(registration.target, (str, type)) or (
            isinstance(registration.target, str) and ":" not in registration.target
        ):
            raise PluginError(
                f"{origin} registered {kind.name}:{name} with target {registration.target!r}; "
                "expected a class or a 'module:Class' string"
            )
        if not self._admits_implementation(origin, f"{kind.name}:{name}"):
            return
        claims = self._claims.setdefault((kind.name, name), [])
        if claims and self.strict:
            raise PluginConflictError(str(Conflict(kind, name, claims[0].origin, origin)))
        claims.append(registration)

    def _admits_plugin(self, origin: Origin) -> bool:
        if origin.plugin in self.deny or origin.distribution in self.deny:
            self._exclude(Exclusion(str(origin), "denied by plugins.deny"))
            return False
        if not self.allow:
            return True
        # An allow list naming single implementations admits every module; the filter runs per implementation.
        if origin.plugin in self.allow or origin.distribution in self.allow or any(":" in a for a in self.allow):
            return True
        self._exclude(Exclusion(str(origin), "not in plugins.allow"))
        return False

    def _admits_implementation(self, origin: Origin, reference: str) -> bool:
        if reference in self.deny:
            self._exclude(Exclusion(f"{reference} ({origin})", "denied by plugins.deny", reference))
            return False
        if not self.allow:
            return True
        if origin.plugin in self.allow or origin.distribution in self.allow or reference in self.allow:
            return True
        self._exclude(Exclusion(f"{reference} ({origin})", "not in plugins.allow", reference))
        return False

    def _exclude(self, exclusion: Exclusion) -> None:
        if exclusion not in self.excluded:
            self.excluded.append(exclusion)

    def _fail(self, origin: Origin, exc: BaseException) -> None:
        error, summary = _summarise(exc)
        failure = LoadFailure(origin, error, summary)
        if self.strict:
            raise PluginLoadError(f"{failure}\n{summary}") from exc
        self.failures.append(failure)

    # -- lookup ----------------------------------------------------------------------------

    @property
    def conflicts(self) -> list[Conflict]:
        """Names claimed by more than one plugin (unusable until all but one are denied or removed)."""
        return [
            Conflict(claims[0].kind, claims[0].name, claims[0].origin, claims[1].origin)
            for claims in self._claims.values()
            if len(claims) > 1
        ]

    def registrations(self, kind: str | None = None) -> list[Registration]:
        """Usable registrations of one kind (or all), sorted by kind then name; conflicting names are left out."""
        found = [
            claims[0]
            for claims in self._claims.values()
            if len(claims) == 1 and (kind is None or claims[0].kind.name == kind)
        ]
        return sorted(found, key=lambda r: (list(KINDS).index(r.kind.name), r.name))

    def names(self, kind: str) -> list[str]:
        """Registered names of ``kind``, sorted."""
        kind_of(kind)
        return [r.name for r in self.registrations(kind)]

    def get(self, kind: str, name: str) -> Registration:
        """The registration of ``kind:name``; unknown or conflicting names raise with the choices."""
        kind_obj = kind_of(kind)
        claims = self._claims.get((kind, name), [])
        if len(claims) > 1:
            raise PluginConflictError(str(Conflict(kind_obj, name, claims[0].origin, claims[1].origin)))
        if not claims:
            reference = f"{kind}:{name}"
            for exclusion in self.excluded:
                if exclusion.reference == reference:
                    raise UnknownPluginError(f"{exclusion}; it is installed but the plugin policy keeps it out")
            available = ", ".join(self.names(kind)) or "none"
            message = f"no {kind_obj.label[:-1]} named {name!r} is installed; available: {available}"
            unknown = [f"  {exclusion}" for exclusion in self.excluded if exclusion.reference is None]
            unknown += [f"  {failure.origin} failed to load: {failure.error}" for failure in self.failures]
            if unknown:
                message += "\nthese plugins were not loaded, so any names they register are missing:\n" + "\n".join(
                    unknown
                )
            raise UnknownPluginError(message)
        return claims[0]

    def resolve(self, kind: str, name: str) -> type[Plugin]:
        """Import and return the implementation class of ``kind:name``."""
        return self.get(kind, name).resolve()


_default: Registry | None = None
_by_policy: dict[tuple[bool, tuple[str, ...], tuple[str, ...]], Registry] = {}


def default_registry(
    *, strict: bool | None = None, allow: Iterable[str] | None = None, deny: Iterable[str] | None = None
) -> Registry:
    """The process-wide registry, loaded once from entry points with the environment's plugin policy.

    Arguments left ``None`` come from ``PATCHBAY_PLUGINS__STRICT``,
    ``PATCHBAY_PLUGINS__ALLOW`` and ``PATCHBAY_PLUGINS__DENY`` as they are
    now.  Each distinct policy loads its registry once and keeps it.
    """
    global _default
    from patchbay.contract.settings import load_settings

    policy = load_settings().plugins
    if _default is None:
        _default = Registry.from_entry_points(strict=policy.strict, allow=policy.allow, deny=policy.deny)
    key = (
        policy.strict if strict is None else strict,
        tuple(sorted(policy.allow if allow is None else allow)),
        tuple(sorted(policy.deny if deny is None else deny)),
    )
    if key == (_default.strict, tuple(sorted(_default.allow)), tuple(sorted(_default.deny))):
        return _default
    if key not in _by_policy:
        _by_policy[key] = Registry.from_entry_points(strict=key[0], allow=key[1], deny=key[2])
    return _by_policy[key]


def registry_for(policy: Any) -> Registry:
    """The registry for a run's ``plugins:`` settings (a :class:`patchbay.contract.settings.PluginPolicy`)."""
    return default_registry(strict=policy.strict, allow=policy.allow, deny=policy.deny)
