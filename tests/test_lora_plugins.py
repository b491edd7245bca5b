"""The two LoRA plugin kinds: the built-ins pass their suites, and the suites catch wrong implementations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patchbay.interfaces import NO_ADAPTER, LoRAKernel, LoRAResolveError
from patchbay.plugins.lora_resolvers.directory_resolver import DirectoryResolver, DirectoryOptions
from patchbay.plugins.lora_kernels.torch_kernel import TorchLoRAKernel
from patchbay.testing import LoRAKernelSuite, LoRAResolverSuite
from patchbay.testing.lora import write_tiny_peft_adapter
from patchbay.worker.lora.mapping import build_lora_mapping


class TestTorchKernel(LoRAKernelSuite):
    plugin_name = "torch"


class TestDirectoryResolver(LoRAResolverSuite):
    plugin_name = "directory"


def test_the_mapping_groups_rows_by_slot_in_row_order():
    mapping = build_lora_mapping(torch.tensor([2, NO_ADAPTER, 0, 2, 0, NO_ADAPTER, 2]))
    assert mapping.active_slots == (0, 2)
    assert mapping.segment_starts == (0, 2, 5)
    assert mapping.order.tolist() == [2, 4, 0, 3, 6]
    assert mapping.has_adapters and mapping.num_rows == 7
    empty = build_lora_mapping(torch.full((3,), NO_ADAPTER))
    assert not empty.has_adapters and empty.segment_starts == (0,) and empty.order.numel() == 0


class _SwappedSlots(TorchLoRAKernel):
    """Wrong on purpose: every row uses the next slot's adapter."""

    def shrink(self, x, lora_a, scalings, mapping):
        return super().shrink(x, lora_a.roll(1, 0), scalings.roll(1, 0), mapping)


class _NoScale(TorchLoRAKernel):
    """Wrong on purpose: ignores the scales."""

    def shrink(self, x, lora_a, scalings, mapping):
        return super().shrink(x, lora_a, torch.ones_like(scalings), mapping)


class _TouchesBaseRows(TorchLoRAKernel):
    """Wrong on purpose: adds a rounding-sized amount to every row, adapter or not."""

    def expand(self, output, h, lora_b, mapping):
        super().expand(output, h, lora_b, mapping)
        output.add_(1e-7)


@pytest.mark.parametrize("broken", [_SwappedSlots, _NoScale, _TouchesBaseRows])
def test_the_kernel_suite_fails_a_wrong_kernel(broken: type[LoRAKernel]):
    suite = LoRAKernelSuite()
    kernel = broken()
    max_rank = 8
    case = suite._case(1, torch.float32, slots=[0, NO_ADAPTER, 1, 0, 1], ranks=[max_rank, 4], max_rank=max_rank)
    with pytest.raises(AssertionError):
        suite._check_add_lora(kernel, case, "float32")


def test_the_directory_resolver_needs_an_existing_root(tmp_path: Path):
    with pytest.raises(ValueError, match="resolver_options.root"):
        DirectoryResolver(DirectoryOptions())
    with pytest.raises(ValueError, match="is not a directory"):
        DirectoryResolver(DirectoryOptions(root=tmp_path / "missing"))


def test_the_directory_resolver_refuses_a_link_out_of_its_root(tmp_path: Path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    write_tiny_peft_adapter(outside / "secret", rank=2)
    (root / "sneaky").symlink_to(outside / "secret")
    resolver = DirectoryResolver(DirectoryOptions(root=root))
    with pytest.raises(LoRAResolveError, match="links outside"):
        resolver.resolve("sneaky")
    assert resolver.available() == []
