"""Registers the built-in LoRA adapter resolver (lazily: nothing is imported until chosen)."""

from patchbay import hookimpl


@hookimpl
def register_lora_resolvers(register):
    register(
        "directory",
        "patchbay.plugins.lora_resolvers.directory_resolver:DirectoryResolver",
        description="adapter NAME is the PEFT directory ROOT/NAME under a configured folder",
    )
