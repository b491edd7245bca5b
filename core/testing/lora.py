"""Conformance suites of the two LoRA kinds: kernels against a dense float64 oracle, resolvers against a folder.

A kernel author's test file::

    from patchbay.testing import LoRAKernelSuite

    class TestMyKernel(LoRAKernelSuite):
        plugin_name = "my_kernel"

The kernel suite draws random layers and adapters (ranks 1 to the largest
the kernel declares, padded with zeros to the stacked rank, as the runner
stacks them), assigns rows to slots (interleaved, some rows without an
adapter, some slots unused) and checks ``add_lora`` -- and ``shrink`` and
``expand`` on their own -- against ``x @ (W + s·B·A)ᵀ`` per row, computed in
float64 from the very weights the kernel saw, for every dtype it declares
and for several target shapes sharing one mapping.  Rows without an adapter
must be left bit for bit as the base product wrote them.

The resolver suite writes a folder of small PEFT adapters and passes it to
the resolver through :meth:`LoRAResolverSuite.resolver_options` (by default
``{"root": FOLDER}``; ``PATCHBAY_TEST_LORA_RESOLVER_OPTIONS`` may hold JSON
options in which ``{adapters}`` stands for the folder).  Besides names that
leave the store, it links folders and files out of it (to a sibling whose
name starts with the store's too), adds an adapter after a miss, replaces one
in place, and tells the resolver the base model with an adapter made for
another.  Kernel options for ``patchbay check`` come from
``PATCHBAY_TEST_LORA_KERNEL_OPTIONS`` (JSON).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest

from patchbay.interfaces import NO_ADAPTER, LoRAKernel, LoRAResolveError, LoRAResolver
from patchbay.testing.kinds import LoRAKernelBaseSuite, LoRAResolverBaseSuite
from patchbay.testing.suite import options_env, skip_not_declared

KERNEL_OPTIONS_ENV = options_env("lora_kernel")
RESOLVER_OPTIONS_ENV = options_env("lora_resolver")
SEED = 20250525

TARGET_SHAPES = {"q_proj": (64, 64), "k_proj": (64, 16), "down_proj": (96, 64)}
"""Several targets of one model, ``name: (in_features, out_features)``, sharing one step's mapping."""
TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (6e-2, 3e-2), "float16": (1e-2, 1e-2)}
"""(atol, rtol) against the float64 oracle, for outputs of magnitude about one."""


class LoRALayerCase:
    """One target layer of a random step: base weight, stacked adapters, scales, rows, and the oracle."""

    def __init__(
        self,
        generator: Any,
        *,
        in_features: int,
        out_features: int,
        ranks: list[int],
        max_rank: int,
        slots: list[int],
        dtype: Any,
    ) -> None:
        import torch

        from patchbay.worker.lora.mapping import build_lora_mapping

        double = torch.float64
        num_rows = len(slots)
        self.weight = torch.randn(out_features, in_features, generator=generator, dtype=double) / in_features**0.5
        self.x = torch.randn(num_rows, in_features, generator=generator, dtype=double)
        self.lora_a = torch.zeros(len(ranks), max_rank, in_features, dtype=double)
        self.lora_b = torch.zeros(len(ranks), out_features, max_rank, dtype=double)
        for slot, rank in enumerate(ranks):  # a rank-0 slot is an empty slot: all zeros
            if rank:
                self.lora_a[slot, :rank] = (
                    torch.randn(rank, in_features, generator=generator, dtype=double) / in_features**0.5
                )
                self.lora_b[slot, :, :rank] = (
                    torch.randn(out_features, rank, generator=generator, dtype=double) / rank**0.5
                )
        self.scalings = 0.5 + 1.5 * torch.rand(len(ranks), generator=generator, dtype=double)
        # What the kernel sees, rounded to its dtype; the oracle uses exactly these values, widened.
        self.x_in, self.a_in, self.b_in = (t.to(dtype) for t in (self.x, self.lora_a, self.lora_b))
        self.w_in = self.weight.to(dtype)
        self.scalings_in = self.scalings.to(torch.float32)
        self.slots = torch.tensor(slots, dtype=torch.int64)
        self.mapping = build_lora_mapping(self.slots)

    def base_output(self) -> Any:
        """The base layer's product in the kernel's dtype (what the runner's linear wrote)."""
        return self.x_in @ self.w_in.T

    def oracle(self) -> Any:
        """``x @ (W + s·B·A)ᵀ`` per row in float64; rows without an adapter get ``x @ Wᵀ``."""
        import torch

        x, w = self.x_in.double(), self.w_in.double()
        a, b, s = self.a_in.double(), self.b_in.double(), self.scalings_in.double()
        rows = []
        for row, slot in enumerate(self.slots.tolist()):
            effective = w if slot == NO_ADAPTER else w + s[slot] * (b[slot] @ a[slot])
            rows.append(x[row] @ effective.T)
        return torch.stack(rows) if rows else x.new_zeros((0, w.shape[0]))

    def shrink_oracle(self) -> Any:
        """``s·x Aᵀ`` per row in float64 (zero rows for rows without an adapter)."""
        import torch

        x, a, s = self.x_in.double(), self.a_in.double(), self.scalings_in.double()
        h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
        for row, slot in enumerate(self.slots.tolist()):
            if slot != NO_ADAPTER:
                h[row] = s[slot] * (x[row] @ a[slot].T)
        return h


class LoRAKernelSuite(LoRAKernelBaseSuite):
    """Numeric checks of a LoRA kernel against the dense per-row oracle."""

    @pytest.fixture
    def kernel_options(self) -> dict[str, Any]:
        """The kernel's options (``PATCHBAY_TEST_LORA_KERNEL_OPTIONS``, JSON; default none)."""
        return self.given_options() or {}

    @pytest.fixture
    def kernel(self, available: type[LoRAKernel], kernel_options: dict[str, Any]) -> LoRAKernel:
        return available(available.Options.model_validate(kernel_options))

    # -- helpers -----------------------------------------------------------------------------

    def _max_rank(self, kernel: LoRAKernel) -> int:
        return min(16, kernel.capabilities.max_lora_rank or 16)

    def _dtype(self, kernel: LoRAKernel, name: str) -> Any:
        import torch

        if name not in kernel.capabilities.dtypes:
            skip_not_declared(f"the kernel does not declare {name}")
        if "cpu" not in kernel.capabilities.devices:
            skip_not_declared("the suite runs on the CPU; the kernel does not declare it")
        return getattr(torch, name)

    def _case(
        self,
        seed: int,
        dtype: Any,
        *,
        slots: list[int],
        ranks: list[int],
        max_rank: int,
        shape: tuple[int, int] = (64, 64),
    ) -> LoRALayerCase:
        import torch

        generator = torch.Generator().manual_seed(seed)
        return LoRALayerCase(
            generator,
            in_features=shape[0],
            out_features=shape[1],
            ranks=ranks,
            max_rank=max_rank,
            slots=slots,
            dtype=dtype,
        )

    def _check_add_lora(self, kernel: LoRAKernel, case: LoRALayerCase, dtype_name: str) -> None:
        import torch

        output = case.base_output()
        base = output.clone()
        kernel.add_lora(output, case.x_in, case.a_in, case.b_in, case.scalings_in, case.mapping)
        assert output.dtype == base.dtype and output.shape == base.shape
        atol, rtol = TOLERANCES[dtype_name]
        torch.testing.assert_close(output.double(), case.oracle(), atol=atol, rtol=rtol)
        without = (case.slots == NO_ADAPTER).nonzero(as_tuple=True)[0]
        assert torch.equal(output[without], base[without]), "rows without an adapter changed"

    # -- checks --------------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
    def test_mixed_batch_matches_the_dense_oracle(self, kernel: LoRAKernel, dtype_name: str) -> None:
        dtype = self._dtype(kernel, dtype_name)
        max_rank = self._max_rank(kernel)
        ranks = [max_rank, 1, max(1, max_rank // 2), 0]  # slot 3 is empty (no adapter loaded)
        slots = [0, NO_ADAPTER, 2, 1, 0, 0, NO_ADAPTER, 2, 1, 1, 0, 2, NO_ADAPTER]
        case = self._case(SEED, dtype, slots=slots, ranks=ranks, max_rank=max_rank)
        # The oracle must tell adapters apart, or this check could not fail.
        import torch

        assert (case.oracle() - case.base_output().double()).abs()[torch.tensor(slots) >= 0].amin(dim=1).max() > 0
        self._check_add_lora(kernel, case, dtype_name)

    @pytest.mark.parametrize("rank", [1, 2, 8, 16])
    def test_every_rank_up_to_the_stacked_rank(self, kernel: LoRAKernel, rank: int) -> None:
        dtype = self._dtype(kernel, "float32")
        max_rank = self._max_rank(kernel)
        if rank > max_rank:
            skip_not_declared(f"the kernel's max_lora_rank is {max_rank}")
        case = self._case(SEED + rank, dtype, slots=[1, 0, 1, 1, 0], ranks=[rank, max_rank], max_rank=max_rank)
        self._check_add_lora(kernel, case, "float32")

    @pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
    def test_several_targets_share_one_mapping(self, kernel: LoRAKernel, dtype_name: str) -> None:
        dtype = self._dtype(kernel, dtype_name)
        max_rank = self._max_rank(kernel)
        slots = [2, 0, NO_ADAPTER, 2, 2, 0, NO_ADAPTER, 1]
        for index, shape in enumerate(TARGET_SHAPES.values()):
            case = self._case(
                SEED + 100 + index,
                dtype,
                slots=slots,
                ranks=[max_rank, 4 if max_rank >= 4 else 1, 2 if max_rank >= 2 else 1],
                max_rank=max_rank,
                shape=shape,
            )
            self._check_add_lora(kernel, case, dtype_name)

    def test_rows_without_an_adapter_are_untouched(self, kernel: LoRAKernel) -> None:
        import torch

        dtype = self._dtype(kernel, "float32")
        max_rank = self._max_rank(kernel)
        case = self._case(SEED + 7, dtype, slots=[NO_ADAPTER] * 6, ranks=[max_rank, max_rank], max_rank=max_rank)
        output = case.base_output()
        base = output.clone()
        kernel.add_lora(output, case.x_in, case.a_in, case.b_in, case.scalings_in, case.mapping)
        assert torch.equal(output, base), "a step without adapter rows changed the output"

    def test_one_row_and_no_rows(self, kernel: LoRAKernel) -> None:
        dtype = self._dtype(kernel, "float32")
        max_rank = self._max_rank(kernel)
        self._check_add_lora(
            kernel,
            self._case(SEED + 8, dtype, slots=[1], ranks=[max_rank, 3 if max_rank >= 3 else 1], max_rank=max_rank),
            "float32",
        )
        self._check_add_lora(
            kernel, self._case(SEED + 9, dtype, slots=[], ranks=[max_rank], max_rank=max_rank), "float32"
        )

    def test_only_the_rows_slots_are_read(self, kernel: LoRAKernel) -> None:
        """Slots no row uses may hold anything (a stale adapter, NaN): they must not reach the output."""
        dtype = self._dtype(kernel, "float32")
        max_rank = self._max_rank(kernel)
        case = self._case(
            SEED + 10, dtype, slots=[0, NO_ADAPTER, 0, 2], ranks=[max_rank, max_rank, 1], max_rank=max_rank
        )
        case.a_in[1] = float("nan")
        case.b_in[1] = float("nan")
        self._check_add_lora(kernel, case, "float32")  # the oracle reads only the slots rows use

    @pytest.mark.parametrize("poison", ["nan", "overflow"])
    def test_a_non_finite_slot_reaches_only_its_own_rows(self, kernel: LoRAKernel, poison: str) -> None:
        """A slot rows use whose product is NaN or overflows to inf spoils those rows alone: every other row
        (another adapter's, or none) matches the oracle, as it would in a step without that slot (issue 57:
        a mask that multiplies by zero turns ``inf`` and NaN into NaN for every row of the step)."""
        import torch

        dtype = self._dtype(kernel, "float32")
        max_rank = self._max_rank(kernel)
        slots = [0, 1, NO_ADAPTER, 1, 0, 2, NO_ADAPTER, 1]
        case = self._case(SEED + 13, dtype, slots=slots, ranks=[max_rank, max_rank, 1], max_rank=max_rank)
        if poison == "nan":
            case.a_in[1, 0, 0] = float("nan")
        else:  # finite weights whose product with any row overflows float32
            case.a_in[1, 0] = torch.finfo(torch.float32).max
        output = case.base_output()
        kernel.add_lora(output, case.x_in, case.a_in, case.b_in, case.scalings_in, case.mapping)
        others = (case.slots != 1).nonzero(as_tuple=True)[0]
        assert torch.isfinite(output[others]).all(), "a non-finite slot reached rows of other slots"
        torch.testing.assert_close(output[others].double(), case.oracle()[others], atol=1e-4, rtol=1e-4)

    def test_slots_rewritten_in_place_are_read_afresh(self, kernel: LoRAKernel) -> None:
        """The runner reloads a slot by overwriting its A, B and scale in place: a kernel keeping anything derived
        from them (stacked or packed weights, scaled masks) must notice, even under the same mapping."""
        dtype = self._dtype(kernel, "float32")
        max_rank = self._max_rank(kernel)
        slots = [0, 1, 0, NO_ADAPTER, 1, 1]
        case = self._case(SEED + 11, dtype, slots=slots, ranks=[max_rank, max_rank], max_rank=max_rank)
        self._check_add_lora(kernel, case, "float32")
        other = self._case(SEED + 12, dtype, slots=slots, ranks=[max_rank, max_rank], max_rank=max_rank)
        case.a_in.copy_(other.a_in)
        case.b_in.copy_(other.b_in)
        case.scalings_in.mul_(3.0)
        self._check_add_lora(kernel, case, "float32")  # the oracle reads the rewritten tensors

    def test_shrink_and_expand_each_match_their_half(self, kernel: LoRAKernel) -> None:
        import torch

        dtype = self._dtype(kernel, "float32")
        max_rank = self._max_rank(kernel)
        case = self._case(
            SEED + 11,
            dtype,
            slots=[1, NO_ADAPTER, 0, 1, 0],
            ranks=[max_rank, 2 if max_rank >= 2 else 1],
            max_rank=max_rank,
        )
        h = kernel.shrink(case.x_in, case.a_in, case.scalings_in, case.mapping)
        assert h.shape == (case.x_in.shape[0], max_rank) and h.dtype == case.x_in.dtype
        torch.testing.assert_close(h.double(), case.shrink_oracle(), atol=1e-4, rtol=1e-4)
        output = case.base_output()
        kernel.expand(output, h, case.b_in, case.mapping)
        torch.testing.assert_close(output.double(), case.oracle(), atol=1e-4, rtol=1e-4)


class LoRAResolverSuite(LoRAResolverBaseSuite):
    """Checks of an adapter resolver over a folder of small PEFT adapters the suite writes and then changes."""

    ADAPTERS: ClassVar[dict[str, int]] = {"alpha": 2, "beta-2": 4}
    """The kit's adapters, name: rank."""
    BASE_MODEL: ClassVar[str] = "kit-org/tiny-base"
    """The base model the kit's adapters name, and the one the resolver is told."""

    def resolver_options(self, folder: Path) -> dict[str, Any]:
        """Options that make the resolver serve the adapters in ``folder`` (override for another kind of store):
        ``{"root": FOLDER}``, or the options given to the kit with ``{adapters}`` standing for the folder."""
        given = self.given_options()
        if given is None:
            return {"root": str(folder)}
        escaped = json.dumps(str(folder))[1:-1]
        return json.loads(json.dumps(given).replace("{adapters}", escaped))

    @pytest.fixture
    def adapter_folder(self, tmp_path: Path) -> Path:
        """The store the suite writes (:meth:`write_store`)."""
        return self.write_store(tmp_path)

    def write_store(self, tmp_path: Path) -> Path:
        """``tmp_path/adapters``, the store; beside it ``outside/secret`` and, in a folder whose name starts with
        the store's, ``adapters-evil/secret``: adapters no name may reach."""
        folder = tmp_path / "adapters"
        folder.mkdir(parents=True)
        for name, rank in self.ADAPTERS.items():
            write_tiny_peft_adapter(folder / name, rank=rank, base_model=self.BASE_MODEL)
        (folder / "not-an-adapter").mkdir()
        (folder / "stray.txt").write_text("not an adapter\n")
        for outside in ("outside", "adapters-evil"):
            write_tiny_peft_adapter(tmp_path / outside / "secret", rank=2, base_model=self.BASE_MODEL)
        return folder

    @pytest.fixture
    def resolver(self, available: type[LoRAResolver], adapter_folder: Path) -> LoRAResolver:
        return available(available.Options.model_validate(self.resolver_options(adapter_folder)))

    def test_resolves_every_adapter_to_its_peft_directory(self, resolver: LoRAResolver, adapter_folder: Path) -> None:
        for name in self.ADAPTERS:
            found = resolver.resolve(name)
            assert found is not None, f"{name!r} did not resolve"
            config = json.loads((Path(found) / "adapter_config.json").read_text())
            written = json.loads((adapter_folder / name / "adapter_config.json").read_text())
            assert config == written, f"{name!r} resolved to another adapter ({found})"
            assert (Path(found) / "adapter_model.safetensors").is_file()

    def test_an_unknown_name_is_none(self, resolver: LoRAResolver) -> None:
        assert resolver.resolve("no-such-adapter") is None

    @pytest.mark.parametrize(
        "name",
        [
            "../outside/secret",
            "../adapters-evil/secret",
            "/etc",
            "",
            ".",
            "..",
            "alpha/..",
            "alpha/../../outside/secret",
        ],
    )
    def test_a_name_never_reaches_outside_the_store(
        self, resolver: LoRAResolver, name: str, adapter_folder: Path
    ) -> None:
        self._assert_not_served(resolver, name, "a name that leaves the store")

    @pytest.mark.parametrize("target", ["outside", "adapters-evil"])
    def test_a_folder_linked_out_of_the_store_never_resolves(
        self, resolver: LoRAResolver, adapter_folder: Path, target: str
    ) -> None:
        """A link in the store to a folder outside it (``adapters-evil`` shares the store's name as a prefix, which
        a containment test on path strings lets through)."""
        _link(adapter_folder / "linked", adapter_folder.parent / target / "secret")
        self._assert_not_served(resolver, "linked", f"a folder that links to {target}/secret, outside the store")

    @pytest.mark.parametrize("which", ["adapter_config.json", "adapter_model.safetensors", "both"])
    def test_files_linked_out_of_the_store_never_resolve(
        self, resolver: LoRAResolver, adapter_folder: Path, which: str
    ) -> None:
        """An adapter folder inside the store whose files are links to an adapter's files outside it."""
        secret = adapter_folder.parent / "adapters-evil" / "secret"
        folder = adapter_folder / "files-linked"
        folder.mkdir()
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            if which in (file, "both"):
                _link(folder / file, secret / file)
            else:
                (folder / file).write_bytes((secret / file).read_bytes())
        self._assert_not_served(resolver, "files-linked", f"a folder whose {which} links outside the store")

    def test_an_adapter_added_after_a_miss_is_found(self, resolver: LoRAResolver, adapter_folder: Path) -> None:
        """A name unknown at first exists once its folder is written: a miss is never remembered."""
        assert resolver.resolve("late") is None
        if resolver.capabilities.can_list:
            assert "late" not in resolver.available()
        write_tiny_peft_adapter(adapter_folder / "late", rank=3, base_model=self.BASE_MODEL)
        found = resolver.resolve("late")
        assert found is not None, (
            "an adapter written after a first resolve('late') returned None is still not found: a resolver must "
            "not remember misses (the operator adds adapters while the server runs)"
        )
        assert json.loads((Path(found) / "adapter_config.json").read_text())["r"] == 3
        if resolver.capabilities.can_list:
            assert "late" in resolver.available(), "available() does not list an adapter added after it was called"

    def test_an_adapter_replaced_in_place_resolves_to_its_new_files(
        self, resolver: LoRAResolver, adapter_folder: Path
    ) -> None:
        """The store's folder rewritten with other weights: the next resolve gives the new files (the runner
        re-reads them the next time it loads the adapter), never a copy kept from before."""
        name = next(iter(self.ADAPTERS))
        first = resolver.resolve(name)
        assert first is not None
        json.loads((Path(first) / "adapter_config.json").read_text())  # read, as the runner does
        shutil.rmtree(adapter_folder / name)
        write_tiny_peft_adapter(adapter_folder / name, rank=8, base_model=self.BASE_MODEL, seed=99)
        found = resolver.resolve(name)
        assert found is not None, f"{name!r} no longer resolves after its folder was rewritten"
        config = json.loads((Path(found) / "adapter_config.json").read_text())
        weights = (Path(found) / "adapter_model.safetensors").read_bytes()
        new_weights = (adapter_folder / name / "adapter_model.safetensors").read_bytes()
        assert config["r"] == 8 and weights == new_weights, (
            f"{name!r} was replaced in place (rank 8, new weights), but resolve() gave {found} holding rank "
            f"{config['r']}{'' if weights == new_weights else ' and other weights'}: a resolver that caches or "
            "copies adapters must check that its copy is current"
        )

    def test_an_adapter_for_another_base_model_is_refused_when_told_the_base_model(
        self, resolver: LoRAResolver, adapter_folder: Path
    ) -> None:
        """``resolve(name, base_model=...)``: an adapter whose config names another base model is refused, with
        both names; the kit's own adapters (made for the base model told) resolve."""
        write_tiny_peft_adapter(adapter_folder / "foreign", rank=2, base_model="kit-org/another-model")
        name = next(iter(self.ADAPTERS))
        try:
            found = resolver.resolve(name, base_model=self.BASE_MODEL)
        except TypeError as exc:
            pytest.fail(f"resolve() must take base_model (lora_resolver contract 1.2): {exc}")
        assert found is not None, f"{name!r}, an adapter for {self.BASE_MODEL!r}, did not resolve when told that base"
        assert resolver.resolve("foreign") is not None, "an adapter must resolve when no base model is told"
        if not resolver.capabilities.checks_base_model:
            skip_not_declared("the resolver declares it cannot tell which base model an adapter is for")
        try:
            refused = resolver.resolve("foreign", base_model=self.BASE_MODEL)
        except LoRAResolveError as exc:
            message = str(exc)
            assert "another-model" in message and "tiny-base" in message, (
                f"the refusal must name the adapter's base model and the run's: {message!r}"
            )
            return
        pytest.fail(
            f"resolve('foreign', base_model={self.BASE_MODEL!r}) gave {refused}, but its adapter_config.json names "
            "base model 'kit-org/another-model': raise LoRAResolveError naming both (or declare "
            "checks_base_model=False)"
        )

    def test_a_directory_without_an_adapter_config_is_not_an_adapter(self, resolver: LoRAResolver) -> None:
        try:
            found = resolver.resolve("not-an-adapter")
        except LoRAResolveError as exc:
            assert str(exc), "the error must say why"
            return
        assert found is None
        assert resolver.resolve("stray.txt") is None

    def test_available_lists_exactly_the_adapters(self, resolver: LoRAResolver) -> None:
        if not resolver.capabilities.can_list:
            assert resolver.available() == []
            skip_not_declared("the resolver declares it cannot list its adapters")
        assert resolver.available() == sorted(self.ADAPTERS)

    def test_resolving_twice_gives_the_same_directory(self, resolver: LoRAResolver) -> None:
        name = next(iter(self.ADAPTERS))
        assert resolver.resolve(name) == resolver.resolve(name)

    def _assert_not_served(self, resolver: LoRAResolver, name: str, what: str) -> None:
        try:
            found = resolver.resolve(name)
        except LoRAResolveError:
            found = None
        assert found is None, f"{name!r}, {what}, resolved to {found}; it must give None or raise LoRAResolveError"
        if resolver.capabilities.can_list:
            assert name not in resolver.available(), f"available() lists {name!r}, {what}"


def _link(link: Path, target: Path) -> None:
    try:
        link.symlink_to(target, target_is_directory=target.is_dir())
    except (OSError, NotImplementedError) as exc:
        skip_not_declared(f"this file system cannot make symbolic links ({exc})")


def write_tiny_peft_adapter(
    path: Path,
    *,
    rank: int,
    hidden: int = 8,
    layers: int = 1,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    base_model: str = "tiny",
    seed: int | None = None,
) -> None:
    """Write a small adapter in PEFT's format (config and safetensors) for a Llama-shaped model of ``hidden`` width.

    Only for the resolver suite, which needs files, not a model; the LoRA
    tests of the runner create their adapters with PEFT itself.
    """
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(rank if seed is None else seed)
    tensors = {}
    for layer in range(layers):
        for target in targets:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, rank, generator=generator)
    save_file(tensors, str(path / "adapter_model.safetensors"))
