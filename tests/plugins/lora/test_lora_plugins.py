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


class _PerSlot(TorchLoRAKernel):
    """The torch kernel with ``add_lora`` through its per-slot ``shrink`` and ``expand``, which the defects break."""

    add_lora = LoRAKernel.add_lora


class _SwappedSlots(_PerSlot):
    """Wrong on purpose: every row uses the next slot's adapter."""

    def shrink(self, x, lora_a, scalings, mapping):
        return super().shrink(x, lora_a.roll(1, 0), scalings.roll(1, 0), mapping)


class _NoScale(_PerSlot):
    """Wrong on purpose: ignores the scales."""

    def shrink(self, x, lora_a, scalings, mapping):
        return super().shrink(x, lora_a, torch.ones_like(scalings), mapping)


class _TouchesBaseRows(_PerSlot):
    """Wrong on purpose: adds a rounding-sized amount to every row, adapter or not."""

    def expand(self, output, h, lora_b, mapping):
        super().expand(output, h, lora_b, mapping)
        output.add_(1e-7)


class _KeepsFirstStackedWeights(TorchLoRAKernel):
    """Wrong on purpose: stacks each B once and never notices a slot reloaded in place."""

    def _stacked(self, lora_b, active):
        kept = self._stacked_b.get(id(lora_b))
        return kept[2] if kept is not None else super()._stacked(lora_b, active)


@pytest.mark.parametrize("broken", [_SwappedSlots, _NoScale, _TouchesBaseRows])
def test_the_kernel_suite_fails_a_wrong_kernel(broken: type[LoRAKernel]):
    suite = LoRAKernelSuite()
    kernel = broken()
    max_rank = 8
    case = suite._case(1, torch.float32, slots=[0, NO_ADAPTER, 1, 0, 1], ranks=[max_rank, 4], max_rank=max_rank)
    with pytest.raises(AssertionError):
        suite._check_add_lora(kernel, case, "float32")


def test_the_kernel_suite_fails_a_kernel_keeping_stale_weights():
    suite = LoRAKernelSuite()
    suite.test_slots_rewritten_in_place_are_read_afresh(TorchLoRAKernel())  # the real one passes
    with pytest.raises(AssertionError):
        suite.test_slots_rewritten_in_place_are_read_afresh(_KeepsFirstStackedWeights())


def test_the_stacked_path_and_the_per_slot_path_agree():
    """The torch kernel stacks the active slots when several are active; its per-slot path is the reference."""
    suite = LoRAKernelSuite()
    case = suite._case(3, torch.float32, slots=[0, NO_ADAPTER, 1, 2, 0, 1], ranks=[8, 4, 2], max_rank=8)
    stacked, per_slot = case.base_output(), case.base_output()
    TorchLoRAKernel().add_lora(stacked, case.x_in, case.a_in, case.b_in, case.scalings_in, case.mapping)
    _PerSlot().add_lora(per_slot, case.x_in, case.a_in, case.b_in, case.scalings_in, case.mapping)
    torch.testing.assert_close(stacked, per_slot, atol=1e-5, rtol=1e-5)
    assert not torch.equal(stacked, case.base_output())


def test_the_directory_resolver_needs_an_existing_root(tmp_path: Path):
    with pytest.raises(ValueError, match="lora.resolver.options.root"):
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
