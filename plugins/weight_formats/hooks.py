"""Registers the built-in weight formats (lazily: nothing heavy is imported here)."""

from patchbay import hookimpl


@hookimpl
def register_weight_formats(register):
    register("gguf", "patchbay.plugins.weight_formats.gguf:GGUFFormat")
    register("gptq", "patchbay.plugins.weight_formats.grouped:GPTQFormat")
    register("awq", "patchbay.plugins.weight_formats.grouped:AWQFormat")
    register("compressed-tensors", "patchbay.plugins.weight_formats.grouped:CompressedTensorsFormat")
    register("int8", "patchbay.plugins.weight_formats.requantize:Int8Format")
    register("w8a8", "patchbay.plugins.weight_formats.requantize:W8A8Format")
    register("int4", "patchbay.plugins.weight_formats.requantize:Int4Format")
