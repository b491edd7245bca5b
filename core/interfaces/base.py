"""What every plugin kind shares: options, capabilities, availability and ``validate``."""

from __future__ import annotations

import dataclasses
from abc import ABC
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

DTYPE_NAMES = ("float32", "bfloat16", "float16")


class NoOptions(BaseModel):
    """The options model of a plugin that takes no options: any key is an error."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class ServingConfig:
    """What the runner asks an implementation to serve.

    Each kind extends this with the facts its implementations are judged on
    (head size, block size, number of draft tokens, ...).
    """

    device: str = "cpu"
    """Device *type* the run uses: ``"cpu"``, ``"cuda"``, ``"mps"``, ..."""
    dtype: str = "float32"
    """Model dtype, one of ``float32``, ``bfloat16``, ``float16`` (also the KV cache's, unless an attention config sets
    ``cache_dtype``)."""


@dataclass(frozen=True)
class Capabilities:
    """Declared capabilities of an implementation.

    The runner, ``auto`` selection, ``patchbay plugins`` and the conformance
    suite all read these.  :meth:`reasons` turns a mismatch with a
    :class:`ServingConfig` into human-readable reasons, so that a plugin's
    declarations and its ``validate`` answer cannot disagree.
    """

    devices: tuple[str, ...] = ("cpu",)
    """Device types the implementation runs on."""
    dtypes: tuple[str, ...] = DTYPE_NAMES
    """Dtypes the implementation supports."""

    def reasons(self, config: ServingConfig) -> list[str]:
        """Return why an implementation with these capabilities cannot serve ``config``.

        An empty list means the capabilities cover the configuration.
        Subclasses extend the list with their own fields (call ``super()``).
        """
        found: list[str] = []
        if config.device not in self.devices:
            found.append(f"device {config.device!r} not supported (supports {', '.join(self.devices)})")
        if config.dtype not in self.dtypes:
            found.append(f"dtype {config.dtype!r} not supported (supports {', '.join(self.dtypes)})")
        return found

    def as_dict(self) -> dict[str, Any]:
        """The capabilities as plain JSON-ready data (tuples become lists)."""
        return {field.name: _jsonable(getattr(self, field.name)) for field in dataclasses.fields(self)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list, frozenset, set)):
        return [_jsonable(item) for item in (sorted(value) if isinstance(value, (set, frozenset)) else value)]
    return value


class Plugin(ABC):  # noqa: B024 - no abstract method of its own: it makes each kind's abstract methods binding
    """Base class of every implementation patchbay resolves from a registry.

    Subclasses set :attr:`capabilities` (an instance of their kind's
    capabilities class) and may set :attr:`Options` to a pydantic model that
    validates the plugin's YAML section.
    """

    kind: ClassVar[str] = ""
    """The registry kind, set by each interface (``attention``, ``sampler``, ...)."""
    Options: ClassVar[type[BaseModel]] = NoOptions
    """Pydantic model of the plugin's ``options:`` section; unknown keys should be errors."""
    capabilities: ClassVar[Capabilities] = Capabilities()
    """Declared capabilities; overridden by every implementation."""
    contract_version: ClassVar[str | None] = None
    """The version of its kind's contract this implementation was built against (``"1.1"``), declared by every
    implementation; :mod:`patchbay.contract.versions` publishes the current versions and decides what loads."""
    known_gaps: ClassVar[Mapping[str, str]] = {}
    """Conformance tests this implementation is known to fail, mapped to the reason.

    ``patchbay check`` and the suites mark them as expected failures (strict:
    a known gap that starts passing is reported so the entry can be removed).
    """

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the implementation cannot run on this machine, or ``None`` if it can.

        Must be cheap and must not initialise a device context; for example
        ``"needs CUDA (torch.cuda.is_available() is False)"``.
        """
        return None

    @classmethod
    def validate(cls, config: ServingConfig) -> list[str]:
        """Return every reason this implementation cannot serve ``config``; empty when it can.

        The default combines :meth:`unavailable_reason` with the declared
        :attr:`capabilities`.  Override to add reasons only the implementation
        knows, and keep the base reasons (call ``super().validate(config)``).
        """
        found: list[str] = []
        reason = cls.unavailable_reason()
        if reason:
            found.append(f"unavailable: {reason}")
        found.extend(cls.capabilities.reasons(config))
        return found
