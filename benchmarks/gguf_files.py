"""GGUF files of the bench's random Llama checkpoints, quantized by llama.cpp's own quantizer.

    .venv/bin/python benchmarks/gguf_files.py --size 1b --types Q4_0 Q8_0 Q4_K_M

builds the random checkpoint of ``--size`` (:data:`patchbay.bench.checkpoints.SIZES`) once, writes it as an F16
GGUF file with patchbay's writer (llama.cpp's converter's names, permutation and tokenizer fields), and has
llama.cpp quantize that file to each of ``--types`` with ``llama_model_quantize`` in the interpreter of the
llama.cpp peer (``make bench-peers``).  It prints each file's path; ``patchbay bench --model FILE`` then runs
patchbay and llama.cpp on the same file.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from patchbay.bench.checkpoints import SIZES, checkpoint_store, size_checkpoint
from patchbay.bench.peers import DEFAULT_PYTHON
from patchbay.plugins.weight_formats.gguf_writer import write_llama_gguf
from patchbay.toolkit.model_files import bundled_gguf

QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = 0
status = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(status)
"""


def quantized_file(source: Path, tensor_type: str, python: Path) -> Path:
    """``source`` (an F16 GGUF file) quantized to ``tensor_type`` by llama.cpp, beside it (made once)."""
    target = source.with_name(source.name.replace(".F16.gguf", f".{tensor_type}.gguf"))
    if not target.exists():
        partial = target.with_suffix(".partial")
        subprocess.run([str(python), "-c", QUANTIZE, str(source), str(partial), tensor_type], check=True)
        partial.rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="1b")
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0", "Q4_K_M"])
    parser.add_argument("--llamacpp-python", type=Path, default=DEFAULT_PYTHON["llamacpp"])
    args = parser.parse_args(argv)
    directory = size_checkpoint(args.size)
    f16 = checkpoint_store() / f"{directory.name}.F16.gguf"
    if not f16.exists():
        partial = f16.with_suffix(".partial")
        write_llama_gguf(directory, partial, bundled_gguf(), "F16")
        partial.rename(f16)
    print(f16)
    for tensor_type in args.types:
        print(quantized_file(f16, tensor_type, args.llamacpp_python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
