"""Registers the built-in LoRA kernel (lazily: nothing is imported until chosen)."""

from patchbay import hookimpl


@hookimpl
def register_lora_kernels(register):
    register(
        "torch",
        "patchbay.plugins.lora_kernels.torch_kernel:TorchLoRAKernel",
        description="rows grouped by adapter slot (index_select), one matmul per active slot, index_add back",
    )
