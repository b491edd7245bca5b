"""Which adapters exist and which are loaded: names resolved (settings, then the resolver), an LRU of loaded ones.

The catalog answers "what is adapter NAME?" for the engine and the runner:
names listed in ``lora.adapters`` first, then the run's ``lora_resolver``
plugin.  Up to ``max_cpu_loras`` adapters stay loaded (read and checked);
loading one more evicts the least recently used that is not pinned.
"""

from __future__ import annotations

import inspect
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from patchbay.contract.settings import DEFAULT_MODEL
from patchbay.interfaces import LoRAResolveError, LoRAResolver
from patchbay.worker.lora.peft_adapter import LinearShape, LoRAAdapter, LoRAAdapterError, load_adapter

if TYPE_CHECKING:
    from patchbay.contract.registry import Registry
    from patchbay.contract.settings import LoRASettings


class UnknownAdapterError(LoRAAdapterError, LookupError):
    """A request named an adapter that neither the settings nor the resolver know."""


class AdapterExistsError(LoRAAdapterError):
    """A runtime load named an adapter that is already served."""


class AdapterInUseError(LoRAAdapterError):
    """An unload named an adapter that requests in flight still use."""


class AdapterCatalog:
    """Adapter names -> directories -> loaded :class:`LoRAAdapter`, keeping at most ``capacity`` loaded."""

    def __init__(
        self,
        *,
        adapters: Mapping[str, Path],
        num_layers: int,
        shapes: Mapping[str, LinearShape],
        max_lora_rank: int,
        capacity: int,
        resolver: LoRAResolver | None = None,
        resolver_name: str | None = None,
        base_model: str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.dtype = dtype
        """The run's dtype: an adapter with a weight beyond its range is refused."""
        self.paths = {name: Path(path) for name, path in adapters.items()}
        self.num_layers = num_layers
        self.shapes = dict(shapes)
        self.max_lora_rank = max_lora_rank
        self.capacity = capacity
        self.resolver = resolver
        self.resolver_name = resolver_name or (type(resolver).__name__ if resolver is not None else None)
        self.base_model = base_model
        """The served model as resolvers are told it (``None``: unknown)."""
        self._resolver_takes_base_model = resolver is not None and _takes_base_model(resolver, self.resolver_name)
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()

    @classmethod
    def from_settings(
        cls,
        section: LoRASettings,
        registry: Registry,
        *,
        num_layers: int,
        shapes: Mapping[str, LinearShape],
        base_model: str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> AdapterCatalog:
        """The catalog of a run's ``lora:`` section; the resolver plugin, if any, is built here and told
        ``base_model`` (see :func:`base_model_name`) with every name it resolves."""
        resolver = None
        if section.resolver is not None:
            resolver_class = cast("type[LoRAResolver]", registry.resolve("lora_resolver", section.resolver.name))
            options = resolver_class.Options.model_validate(dict(section.resolver.options))
            resolver = resolver_class(options)
        return cls(
            adapters=section.adapters,
            num_layers=num_layers,
            shapes=shapes,
            max_lora_rank=section.max_lora_rank,
            capacity=section.cpu_capacity,
            resolver=resolver,
            resolver_name=f"lora_resolver:{section.resolver.name}" if section.resolver else None,
            base_model=base_model,
            dtype=dtype,
        )

    def path_of(self, name: str) -> Path:
        """The directory of adapter ``name``: listed in settings, else found by the resolver."""
        if name in self.paths:
            return self.paths[name]
        if self.resolver is not None:
            try:
                if self._resolver_takes_base_model:
                    found = self.resolver.resolve(name, base_model=self.base_model)
                else:
                    found = self.resolver.resolve(name)
            except LoRAResolveError as exc:
                raise LoRAAdapterError(
                    f"LoRA adapter {name!r}: {self.resolver_name} could not provide it: {exc}"
                ) from None
            if found is not None:
                return Path(found)
        known = sorted(self.known_names())
        listed = ", ".join(known) if known else "none"
        where = f" and {self.resolver_name} does not know it" if self.resolver is not None else ""
        raise UnknownAdapterError(f"unknown LoRA adapter {name!r}: not in lora.adapters{where} (known: {listed})")

    def known_names(self) -> list[str]:
        """Names listed in settings and those the resolver lists, sorted."""
        names = set(self.paths)
        if self.resolver is not None:
            names.update(self.resolver.available())
        return sorted(names)

    def get(self, name: str, *, pinned: Iterable[str] = ()) -> LoRAAdapter:
        """Adapter ``name``, loaded now if needed (evicting the least recently used one not in ``pinned``)."""
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
            return adapter
        adapter = self._read(name, self.path_of(name))
        self._keep(adapter, pinned=pinned)
        return adapter

    def _read(self, name: str, path: Path) -> LoRAAdapter:
        return load_adapter(
            name,
            path,
            num_layers=self.num_layers,
            shapes=self.shapes,
            max_lora_rank=self.max_lora_rank,
            dtype=self.dtype,
        )

    def _keep(self, adapter: LoRAAdapter, *, pinned: Iterable[str]) -> None:
        """Hold ``adapter`` loaded, evicting the least recently used ones not in ``pinned`` beyond capacity."""
        keep = set(pinned)
        while len(self._loaded) >= self.capacity:
            victim = next((loaded for loaded in self._loaded if loaded not in keep), None)
            if victim is None:
                break  # every loaded adapter is in use this step; go over capacity rather than fail the step
            del self._loaded[victim]
        self._loaded[adapter.name] = adapter

    def add(self, name: str, path: Path | str) -> LoRAAdapter:
        """Read and check the adapter at ``path`` and serve it as ``name`` from now on (runtime loading).

        Raises :class:`AdapterExistsError` for a name already served and
        :class:`LoRAAdapterError` (naming the adapter) for one that cannot run.
        """
        if name in self.paths or name in self._loaded:
            raise AdapterExistsError(f"LoRA adapter {name!r} is already loaded; unload it first to replace it")
        adapter = self._read(name, Path(path))
        self.paths[name] = Path(path)
        self._keep(adapter, pinned=())
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving adapter ``name`` (listed in settings or loaded at runtime); :class:`UnknownAdapterError`
        for any other name (an adapter the resolver finds is not unloaded: it would be found again)."""
        if name not in self.paths:
            listed = ", ".join(sorted(self.paths)) or "none"
            raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded (loaded: {listed})")
        del self.paths[name]
        self._loaded.pop(name, None)

    @property
    def loaded_names(self) -> list[str]:
        """Loaded adapters, least recently used first."""
        return list(self._loaded)


BUNDLED_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hugging Face id of the bundled model (``model.path: default``), as adapters trained on it name it."""


def base_model_name(model_path: str) -> str | None:
    """What resolvers are told of the served model: ``model.path`` as written, the bundled model's Hugging Face id
    for ``default``, and ``None`` for a GGUF file, whose name (a quantization tag, a renamed copy) says too
    little to compare with the base model an adapter names."""
    if model_path == DEFAULT_MODEL:
        return BUNDLED_BASE_MODEL
    if model_path.lower().endswith(".gguf"):
        return None
    return model_path


def _takes_base_model(resolver: LoRAResolver, who: str | None) -> bool:
    """Whether ``resolver.resolve`` accepts ``base_model`` (contract 1.2); a 1.1 resolver is called without it,
    with a deprecation warning naming it."""
    try:
        parameters = inspect.signature(resolver.resolve).parameters
    except (TypeError, ValueError):
        return True
    if "base_model" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return True
    warnings.warn(
        f"{who}: resolve() takes no base_model (the lora_resolver contract 1.1 form); it is called without it, "
        "so it cannot refuse adapters made for another base model. Accept resolve(name, *, base_model=None) "
        "and declare contract_version = '1.2'",
        DeprecationWarning,
        stacklevel=3,
    )
    return False
