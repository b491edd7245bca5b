"""The runner tells its LoRA resolver the base model it serves (lora_resolver contract 1.2), and still calls a
resolver of contract 1.1, whose ``resolve`` takes a name only, with a deprecation warning naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from patchbay.interfaces import LoRAResolver
from patchbay.plugins.lora_resolvers.directory_resolver import DirectoryOptions, DirectoryResolver
from patchbay.testing.lora import write_tiny_peft_adapter
from patchbay.worker.lora.catalog import AdapterCatalog, base_model_name
from patchbay.worker.lora.peft_adapter import LoRAAdapterError


def catalog_of(resolver: LoRAResolver, name: str, base_model: str | None) -> AdapterCatalog:
    return AdapterCatalog(
        adapters={},
        num_layers=1,
        shapes={},
        max_lora_rank=8,
        capacity=1,
        resolver=resolver,
        resolver_name=f"lora_resolver:{name}",
        base_model=base_model,
    )


class Recording(LoRAResolver):
    """Resolves every name to one folder, recording what it was told."""

    contract_version = "1.2"

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self.told: list[tuple[str, str | None]] = []

    def resolve(self, name: str, *, base_model: str | None = None) -> Path | None:
        self.told.append((name, base_model))
        return self.folder


class OldStyle(LoRAResolver):
    """A resolver written against contract 1.1: ``resolve(name)`` only."""

    contract_version = "1.1"

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def resolve(self, name):  # type: ignore[override]
        return self.folder


def test_the_catalog_tells_the_resolver_the_base_model(tmp_path: Path):
    resolver = Recording(tmp_path)
    assert catalog_of(resolver, "recording", "org/base").path_of("x") == tmp_path
    assert resolver.told == [("x", "org/base")]


def test_a_contract_1_1_resolver_is_called_without_the_base_model_with_a_warning(tmp_path: Path):
    with pytest.warns(DeprecationWarning, match=r"lora_resolver:old: resolve\(\) takes no base_model"):
        catalog = catalog_of(OldStyle(tmp_path), "old", "org/base")
    assert catalog.path_of("x") == tmp_path


def test_the_directory_resolver_refuses_an_adapter_for_another_base_model(tmp_path: Path):
    write_tiny_peft_adapter(tmp_path / "bigger", rank=2, base_model="HuggingFaceTB/SmolLM2-360M-Instruct")
    resolver = DirectoryResolver(DirectoryOptions(root=tmp_path))
    bundled = catalog_of(resolver, "directory", base_model_name("default"))
    with pytest.raises(
        LoRAAdapterError,
        match=r"'bigger': lora_resolver:directory could not provide it: .* an adapter for base model "
        r"'HuggingFaceTB/SmolLM2-360M-Instruct' .* this run serves 'HuggingFaceTB/SmolLM2-135M-Instruct'",
    ):
        bundled.path_of("bigger")
    # A local copy of the adapter's base model, under its own name, is that model.
    assert catalog_of(resolver, "directory", "/models/SmolLM2-360M-Instruct/").path_of("bigger") == tmp_path / "bigger"
    # Told nothing, or told not to check, the resolver serves it.
    assert catalog_of(resolver, "directory", None).path_of("bigger") == tmp_path / "bigger"
    unchecked = DirectoryResolver(DirectoryOptions(root=tmp_path, check_base_model=False))
    assert catalog_of(unchecked, "directory", base_model_name("default")).path_of("bigger") == tmp_path / "bigger"


@pytest.mark.parametrize(
    ("model_path", "told"),
    [
        ("default", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        ("/models/Llama-3.2-1B-Instruct", "/models/Llama-3.2-1B-Instruct"),
        ("/models/smollm2-135m-instruct-q8_0.gguf", None),
    ],
)
def test_what_the_resolver_is_told_of_the_model(model_path: str, told: str | None):
    assert base_model_name(model_path) == told
