"""The bundled SmolLM2 GGUF file as float weights, for tests that compare the engine with transformers on it.

patchbay runs the file's Q4_1 blocks packed by default, rounding activations to int8 per 32 inputs as llama.cpp
does; transformers dequantizes the file to float32.  A test of the engine's machinery against transformers gives
the engine the same float weights (:data:`FLOAT_WEIGHTS`) and transformers the float directory
(:func:`float_model_dir`).
"""

from __future__ import annotations

from pathlib import Path

FLOAT_WEIGHTS = {"name": "gguf", "options": {"dequantize": True}}
"""``model.weight_format`` that loads a GGUF file's weights dequantized, as transformers reads them."""


def float_model_dir() -> Path:
    """The bundled model converted once to a float safetensors directory (cached)."""
    from patchbay.toolkit.model_files import resolve_model_dir

    return resolve_model_dir("default")
