"""Registers the built-in LoRA kernel and adapter resolver (lazily: nothing is imported until chosen)."""

from patchbay import hookimpl


@hookimpl
def register_lora_kernels(register):
    register("torch", "patchbay.plugins.lora.torch_kernel:TorchLoRAKernel",
             description="rows grouped by adapter slot (index_select), one matmul per active slot, index_add back")


@hookimpl
def register_lora_resolvers(register):
    register("directory", "patchbay.plugins.lora.directory_resolver:DirectoryResolver",
             description="adapter NAME is the PEFT directory ROOT/NAME under a configured folder")
