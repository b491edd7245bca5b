"""Every built-in weight format against the ``weight_format`` conformance suite (gguf in test_gguf.py)."""

from __future__ import annotations

from patchbay.testing import WeightFormatSuite


class TestGPTQ(WeightFormatSuite):
    plugin_name = "gptq"


class TestAWQ(WeightFormatSuite):
    plugin_name = "awq"


class TestCompressedTensors(WeightFormatSuite):
    plugin_name = "compressed-tensors"


class TestInt4(WeightFormatSuite):
    plugin_name = "int4"


class TestW8A8(WeightFormatSuite):
    plugin_name = "w8a8"


class TestInt8(WeightFormatSuite):
    plugin_name = "int8"
