"""The published contract version of each plugin kind, and the rule that says which plugins may load.

Each kind's contract (its interface in :mod:`patchbay.interfaces`, its hook
spec and what its conformance suite checks) carries a semantic version
``MAJOR.MINOR.PATCH``.  An implementation says which version it was built
against with the class attribute ``contract_version`` (a string such as
``"1.1"`` or ``"1.1.0"``; see :attr:`patchbay.interfaces.Plugin.contract_version`).
When the registry resolves it, :func:`check_compatibility` decides:

- same major, same minor (any patch): loads;
- same major, one of the :data:`SUPPORTED_OLDER_MINORS` minors before the current one:
  loads with a :class:`DeprecationWarning` naming the plugin and the version;
- anything else (another major, a newer minor than this core, a minor older than
  the oldest supported one, a string that is not a version): refused with a
  :class:`ContractVersionError` naming the plugin, both versions and the fix;
- nothing declared: treated as the current version, with a
  :class:`PluginContractWarning` asking the author to declare it.

This module is the one source of truth for the versions; ``patchbay plugins``,
the plugin guide and the registry all read it.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

CONTRACT_VERSIONS: dict[str, str] = {
    "attention": "1.1.0",
    "attention_metadata_builder": "1.1.0",
    "drafter": "1.1.0",
    "sampler": "1.1.0",
    "kv_connector": "1.1.0",
    "structured_output": "1.1.0",
    "lora_kernel": "1.1.0",
    "lora_resolver": "1.2.0",
    "tool_parser": "1.2.0",
    "reasoning_parser": "1.2.0",
    "weight_format": "1.1.0",
    "pooler": "1.1.0",
    "architecture": "1.1.0",
}
"""Kind name -> the contract version this core publishes."""

TOOLKIT_VERSION = "1.3.0"
"""The version of the public plugin toolkit (:mod:`patchbay.toolkit`), under the same semantic rules as a kind's
contract: a name in a toolkit module's ``__all__`` keeps its meaning within a major version, a minor version
adds names, and a removed or changed name bumps the major version (after a deprecation for
:data:`SUPPORTED_OLDER_MINORS` minor versions)."""

TOOLKIT_CHANGES: dict[str, str] = {
    "1.0": (
        "the toolkit published: native builds of C++ sources with the machine's flags, the CPU's flags, tiled "
        "products and their helper threads, the fused CPU ops, int8 KV-cache rows, the cache folder, model files "
        "and decoder hidden states for drafters"
    ),
    "1.1": (
        "local_files: files a request names opened below a trusted folder without following links out, regular "
        "files only (no FIFO or device), read within a size and a time"
    ),
    "1.2": (
        "for architecture plugins: the forward context through which attention layers reach the run's backend "
        "(forward_context, moved from the worker), and transformers models' attention layers read as layer specs "
        "(transformers_layers)"
    ),
    "1.3": "block_tiles: GGUF's quantized blocks (Q4_0 ... Q6_K) as tiles, their products, rows and slices",
}
"""Toolkit MAJOR.MINOR -> what it added or changed."""

SUPPORTED_OLDER_MINORS = 2
"""How many minor versions before the current one still load, with a deprecation warning (the policy in the
plugin guide): a plugin built against 1.0 loads under 1.1 and 1.2 and is refused from 1.3 on."""

CHANGES: dict[str, str] = {
    "1.0": "the contract as of patchbay 0.x before versioning (every kind)",
    "1.1": (
        "versioned contract; structured_output: the token_bytes helper, checks on non-ASCII text, half-sent "
        "characters, tokens refused half way, compile time and concurrent compiles; kv_connector: entries "
        "authenticated with sign_entry / verify_entry, the 'forged' fault, consumers that never write; sampler: "
        "masked (-inf) rows, logprobs with random rows, seeded streams that advance; drafter: drafts follow "
        "requests, not rows; attention_metadata_builder: results readable by the kit's reference reader; pooler: the "
        "kind published; attention: encoder-only batches (bidirectional, no KV cache) where a backend declares them"
    ),
    "1.2": (
        "tool_parser: the arguments_syntax capability, string-valued arguments, one parser serving interleaved "
        "streams, and kit checks on model-written calls (escapes, unbalanced brackets in strings, text after "
        "calls) over every declared option combination; reasoning_parser: an output cut inside its reasoning is "
        "reasoning, whitespace before the markup is not content, interleaved streams; lora_resolver: resolve() "
        "is told the base_model (checks_base_model), files linked out of the store never resolve, and every "
        "call answers from the store as it is now"
    ),
}
"""MAJOR.MINOR -> what that version added or changed (the plugin guide lists these)."""

_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?$")


class ContractVersionError(ValueError):
    """A plugin built against a contract version this core cannot honour; the message says what to do."""


class PluginContractWarning(UserWarning):
    """A plugin that declares no contract version (it is treated as built against the current one)."""


@dataclass(frozen=True, order=True)
class ContractVersion:
    """A parsed ``MAJOR.MINOR[.PATCH]`` version."""

    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> ContractVersion:
        """Parse ``"1.1"`` or ``"1.1.0"``; anything else raises ``ValueError``."""
        match = _VERSION.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"{text!r} is not a contract version (expected MAJOR.MINOR or MAJOR.MINOR.PATCH)")
        return cls(int(match[1]), int(match[2]), int(match[3] or 0))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def current_version(kind: str) -> ContractVersion:
    """The contract version this core publishes for ``kind``."""
    try:
        return ContractVersion.parse(CONTRACT_VERSIONS[kind])
    except KeyError:
        raise KeyError(f"no contract version for plugin kind {kind!r}; kinds: {', '.join(CONTRACT_VERSIONS)}") from None


def declared_version(implementation: type) -> str | None:
    """What ``implementation`` declares in ``contract_version`` (``None`` when nothing is declared)."""
    declared = getattr(implementation, "contract_version", None)
    return declared if declared is None else str(declared)


def check_compatibility(kind: str, implementation: type, who: str) -> ContractVersion:
    """The version ``implementation`` (called ``who`` in messages) is treated as built against.

    Raises :class:`ContractVersionError` for an incompatible declaration;
    warns for a deprecated minor version or a missing declaration.
    """
    current = current_version(kind)
    declared_text = declared_version(implementation)
    current_text = f"{current.major}.{current.minor}"
    if declared_text is None:
        warnings.warn(
            f"{who} declares no contract_version; treated as built against the {kind} contract {current}. "
            f"Declare it on the class: contract_version = {current_text!r}",
            PluginContractWarning,
            stacklevel=3,
        )
        return current
    try:
        declared = ContractVersion.parse(declared_text)
    except ValueError as exc:
        raise ContractVersionError(
            f"{who}: contract_version {exc}; declare contract_version = {current_text!r}"
        ) from None
    oldest = max(0, current.minor - SUPPORTED_OLDER_MINORS)
    if declared.major != current.major or declared.minor > current.minor or declared.minor < oldest:
        if declared.major != current.major:
            why = "the major version differs, so its interface changed incompatibly"
        elif declared.minor > current.minor:
            why = "it needs a newer patchbay than this one"
        else:
            why = f"minor versions older than {current.major}.{oldest} are no longer supported"
        raise ContractVersionError(
            f"{who} was built against the {kind} contract {declared}, but this patchbay provides {current} "
            f"({why}); fix: install a release of the plugin built for contract {current.major}.{current.minor}, "
            f"or a patchbay whose {kind} contract is {declared.major}.{declared.minor}.x "
            f"(`patchbay plugins` lists the versions)"
        )
    if declared.minor < current.minor:
        warnings.warn(
            f"{who} was built against the {kind} contract {declared}; this patchbay provides {current}. "
            f"Contract {declared.major}.{declared.minor} is deprecated: it keeps loading up to contract "
            f"{declared.major}.{declared.minor + SUPPORTED_OLDER_MINORS} (the plugin guide's deprecation policy); "
            f"update the plugin and declare contract_version = {current_text!r}",
            DeprecationWarning,
            stacklevel=3,
        )
    return declared
