"""Structured output in the engine: the run's grammar backend, checked and built from settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from patchbay.contract.registry import Registry
from patchbay.contract.selection import require_serves
from patchbay.contract.settings import Settings, plugin_options
from patchbay.interfaces import StructuredOutputBackend, StructuredOutputConfig
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.structured_output import GrammarCompilations


def grammar_compilations(
    settings: Settings,
    registry: Registry,
    *,
    device: str,
    dtype: str,
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: Sequence[int],
) -> GrammarCompilations:
    """The compile service of ``structured_output.name``; the backend itself is built on the first constraint.

    Its name, options and capabilities are checked now, so a bad section
    fails the run at start, not at the first constrained request.
    """
    section = settings.structured_output
    backend_class: type[StructuredOutputBackend] = registry.resolve("structured_output", section.name)  # type: ignore[assignment]
    config = StructuredOutputConfig(device=device, dtype=dtype, needs_rollback=settings.spec_decode is not None)
    require_serves(backend_class, f"structured_output:{section.name}", "structured_output.name", [config])
    options = plugin_options(backend_class, section.options, where="structured_output.options")

    def build() -> StructuredOutputBackend:
        return backend_class(options, tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)

    return GrammarCompilations(
        build,
        section.name,
        constraint_kinds=backend_class.capabilities.constraint_kinds,
        cache_bytes=section.cache_bytes,
        compile_timeout=section.compile_timeout,
        max_workers=section.compile_workers,
        max_queued=section.max_queued_compiles,
    )


def check_constraint(request_id: str, params: SamplingParams, grammars: GrammarCompilations) -> None:
    """Refuse a request whose constraint kind the backend does not compile (``ValueError`` naming all three)."""
    constraint = params.structured_output
    if constraint is None:
        return
    kinds = grammars.constraint_kinds
    if constraint.kind not in kinds:
        raise ValueError(
            f"request {request_id!r}: structured_output backend {grammars.backend_name!r} does not "
            f"support {constraint.field_path} (it supports {', '.join(kinds)})"
        )
