"""Registers the built-in LoRA kernel (lazily: nothing is imported until chosen)."""

from patchbay import hookimpl


@hookimpl
def register_lora_kernels(register):
    register(
        "torch",
        "patchbay.plugins.lora_kernels.torch_kernel:TorchLoRAKernel",
        description="active slots stacked into two products per linear; per-slot products for one adapter on few rows",
    )
