"""A fingerprint of a model directory's weights, for the identity KV blocks are stored under.

Two checkpoints of one architecture have the same ``config.json``, and often
weight files of the same size; their KV differs.  Hashing whole files would
cost seconds per gigabyte at every start, so each weight file contributes its
name, its size and samples of its bytes: the first and last 64 KiB (a
safetensors header names every tensor's dtype, shape and offsets) and
:data:`NUM_SAMPLES` evenly spaced 4 KiB pieces between.  Any retraining or
fine-tune changes nearly every value, so it changes the samples; the
fingerprint does not depend on file times, so copies of one checkpoint on
several machines share entries.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
EDGE_BYTES = 64 << 10
SAMPLE_BYTES = 4 << 10
NUM_SAMPLES = 64


def weights_fingerprint(model_dir: Path) -> str:
    """Hex digest over every weight file under ``model_dir`` (see the module docstring)."""
    digest = hashlib.sha256()
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(model_dir)}\0{size}\0".encode())
        with path.open("rb") as file:
            offsets = [0, max(0, size - EDGE_BYTES)]
            offsets += [size * (index + 1) // (NUM_SAMPLES + 1) for index in range(NUM_SAMPLES)]
            for number, offset in enumerate(offsets):
                file.seek(offset)
                digest.update(file.read(EDGE_BYTES if number < 2 else SAMPLE_BYTES))
    return digest.hexdigest()
