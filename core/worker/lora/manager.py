"""The runner's LoRA state: the catalog, the ``max_loras`` slots and each step's row -> slot mapping.

:func:`install_lora` wraps the model's target linears and returns the
:class:`LoRAManager`.  Each step the runner hands it the adapter name of
every request in the step; the manager puts each adapter in a slot (loading
it through the catalog and evicting the least recently used slot no row of
this step uses), then builds the step's mapping in one vectorised pass.

A slot is matched by the adapter's identity (its fingerprint), not its name
alone: when the catalog's adapter of a name is no longer the one a slot
holds (a runtime load under a name the resolver served, an edited folder
read again), the slot is written again before any row uses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np
import torch
from torch import nn

from patchbay.contract.registry import Registry
from patchbay.contract.settings import ConfigError, ConfigProblem, LoRASettings, plugin_options
from patchbay.interfaces import NO_ADAPTER, LoRAKernel, LoRAKernelConfig
from patchbay.worker.lora.catalog import AdapterCatalog
from patchbay.worker.lora.layers import LoRALinear, LoRAStep
from patchbay.worker.lora.mapping import build_lora_mapping
from patchbay.worker.parallel.tensor_parallel import ProjectionSlice
from patchbay.worker.lora.peft_adapter import TARGET_MODULES, LoRAAdapter, LoRAAdapterError, base_model_shapes


class LoRAManager:
    """Slots of active adapters over one model's wrapped linears."""

    def __init__(
        self, catalog: AdapterCatalog, step: LoRAStep, linears: dict[tuple[int, str], LoRALinear], max_loras: int
    ) -> None:
        self.catalog = catalog
        self.step = step
        self.linears = linears
        self.max_loras = max_loras
        self.slot_names: list[str | None] = [None] * max_loras
        self.slot_fingerprints: list[str | None] = [None] * max_loras
        """The identity of the adapter each slot holds (``None``: empty)."""
        self._recency: list[int] = []
        """Slots, least recently used first."""

    def check(self, name: str) -> LoRAAdapter:
        """Adapter ``name`` loaded and checked (raises :class:`LoRAAdapterError` naming it and why)."""
        return self.catalog.get(name, pinned=[n for n in self.slot_names if n is not None])

    def identity(self, name: str) -> bytes:
        """What prefix-cache and KV-connector keys of adapter ``name`` carry: its weights' fingerprint."""
        return self.check(name).fingerprint.encode()

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Serve the adapter at ``path`` as ``name`` from now on (read and checked now: :meth:`AdapterCatalog.add`)."""
        return self.catalog.add(name, path)

    def unload(self, name: str) -> None:
        """Stop serving adapter ``name`` and free its slot (the caller makes sure no request uses it)."""
        self.catalog.remove(name)
        if name in self.slot_names:
            slot = self.slot_names.index(name)
            self.slot_names[slot] = self.slot_fingerprints[slot] = None
            if slot in self._recency:
                self._recency.remove(slot)

    def begin_step(self, names: Sequence[str | None], num_scheduled: np.ndarray) -> None:
        """Put the step's adapters in slots and publish the mapping of its tokens (request ``i`` has
        ``num_scheduled[i]`` tokens and adapter ``names[i]``)."""
        wanted = [name for name in dict.fromkeys(names) if name is not None]
        if not wanted:
            self.step.mapping = None
            return
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters but lora.max_loras is {self.max_loras}")
        slot_of = {name: self._slot_for(name, wanted) for name in wanted}
        request_slots = np.fromiter(
            (NO_ADAPTER if name is None else slot_of[name] for name in names), dtype=np.int64, count=len(names)
        )
        token_slots = torch.from_numpy(np.repeat(request_slots, num_scheduled))
        self.step.mapping = build_lora_mapping(token_slots.to(self.step.scalings.device))

    def end_step(self) -> None:
        """The forward pass is over: the model runs as the base model again."""
        self.step.mapping = None

    def _slot_for(self, name: str, step_names: Sequence[str]) -> int:
        adapter = self.catalog.get(name, pinned=step_names)
        if name in self.slot_names:
            slot = self.slot_names.index(name)
            if self.slot_fingerprints[slot] != adapter.fingerprint:  # the name now means other weights or config
                self._load(slot, adapter)
        else:
            free = [slot for slot, held in enumerate(self.slot_names) if held is None]
            if free:
                slot = free[0]
            else:
                slot = next(s for s in self._recency if self.slot_names[s] not in step_names)
            self._load(slot, adapter)
        if slot in self._recency:
            self._recency.remove(slot)
        self._recency.append(slot)
        return slot

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for key, linear in self.linears.items():
            pair = adapter.weights.get(key)
            if pair is None:
                linear.set_slot(slot, None, None)
            else:
                linear.set_slot(slot, pair[0].to(linear.lora_a.dtype), pair[1].to(linear.lora_b.dtype))
        self.step.scalings[slot] = adapter.scaling
        self.slot_names[slot] = adapter.name
        self.slot_fingerprints[slot] = adapter.fingerprint


def install_lora(
    model: object,
    section: LoRASettings,
    registry: Registry,
    *,
    device: torch.device,
    dtype: torch.dtype,
    slices: Mapping[str, ProjectionSlice] | None = None,
    base_model: str | None = None,
) -> LoRAManager:
    """Wrap ``model``'s (an ``HFCausalLM``) target linears and return the manager of its adapter slots.

    ``slices``: what this tensor-parallel rank keeps of each projection
    (``ShardLayout.projection_slices``; ``None`` on one rank). Forward hooks
    of a wrapped linear (a rank's sum of partial outputs) move to its wrapper,
    so they see the adapted output.  The listed adapters are each read and
    checked now, so a bad one fails the run at start, naming it.  The
    resolver, if any, is told ``base_model`` with each name it resolves.
    """
    kernel_class = cast("type[LoRAKernel]", registry.resolve("lora_kernel", section.kernel.name))
    reasons = kernel_class.validate(
        LoRAKernelConfig(
            device=device.type,
            dtype=str(dtype).removeprefix("torch."),
            max_lora_rank=section.max_lora_rank,
            max_loras=section.max_loras,
        )
    )
    if reasons:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "lora.kernel.name",
                    f"lora_kernel:{section.kernel.name} cannot serve this run: {'; '.join(reasons)}",
                    plugin=f"lora_kernel:{section.kernel.name}",
                )
            ]
        )
    kernel = kernel_class(plugin_options(kernel_class, section.kernel.options, where="lora.kernel.options"))
    config = model.model.config  # type: ignore[attr-defined]
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers, shapes = base_model_shapes(text_config)
    catalog = AdapterCatalog.from_settings(
        section, registry, num_layers=num_layers, shapes=shapes, base_model=base_model, dtype=dtype
    )
    step = LoRAStep(kernel=kernel, scalings=torch.zeros(section.max_loras, dtype=torch.float32, device=device))
    layers = getattr(model._decoder, "layers", None)  # type: ignore[attr-defined]
    if not isinstance(layers, nn.ModuleList) or len(layers) != num_layers:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "lora",
                    f"this model's decoder has no list of {num_layers} layers, so LoRA cannot wrap its projections",
                )
            ]
        )
    linears: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(layers):
        for module, block_name in TARGET_MODULES.items():
            block = getattr(layer, block_name, None)
            base = getattr(block, module, None) if block is not None else None
            if base is None:
                raise ConfigError(
                    [
                        ConfigProblem(
                            "<run>",
                            "lora",
                            f"layer {index} has no {block_name}.{module}, "
                            "so LoRA cannot wrap it (Llama-like decoders only)",
                        )
                    ]
                )
            shape = shapes[module]
            keeps = slices.get(module) if slices is not None else None
            in_features, out_features = shape.in_features, shape.out_features
            if keeps is not None and keeps.keeps == "outputs":
                out_features = keeps.stop - keeps.start
            elif keeps is not None:
                in_features = keeps.stop - keeps.start
            wrapped = LoRALinear(
                base,
                step,
                in_features=in_features,
                out_features=out_features,
                max_loras=section.max_loras,
                max_rank=section.max_lora_rank,
                dtype=dtype,
                device=device,
                keeps=keeps,
            )
            wrapped._forward_hooks.update(base._forward_hooks)
            base._forward_hooks.clear()
            setattr(block, module, wrapped)
            linears[(index, module)] = wrapped
    for name in catalog.paths:
        try:
            catalog.get(name)
        except LoRAAdapterError as exc:
            raise ConfigError([ConfigProblem("<run>", f"lora.adapters.{name}", str(exc))]) from None
    return LoRAManager(catalog, step, linears, section.max_loras)
