"""The sections of the engine itself: the model, the runtime (device, kernels, ranks), the KV cache and the
scheduler."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)
from pydantic_settings import NoDecode

from patchbay.contract.settings.plugin_sections import Choice
from patchbay.contract.settings.sections import (
    DEFAULT_MODEL,
    PluginChoice,
    Section,
    _byte_size_or_auto,
    _expand_home,
    _split_names,
    choice_shorthand,
    renamed_keys,
)


class ModelSettings(Section):
    """Which model runs, in which dtype and with which weights."""

    path: str = DEFAULT_MODEL
    """A local Hugging Face model directory (with ``config.json``), a ``.gguf`` file (its quantized blocks run as
    they are, docs/design/model-loading.md), or ``default`` for the bundled SmolLM2-135M-Instruct (a Q4_1 GGUF).
    Nothing is downloaded."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and KV cache (unless ``cache.dtype`` sets the cache's). ``auto``: bfloat16 on CUDA; on a CPU the
    fastest dtype it computes natively, measured once (``patchbay tune``), or bfloat16 where it has it under
    ``w8a8`` or ``int4`` tiles. In bfloat16 greedy tokens can differ at near-ties as batching changes;
    ``float32`` keeps them (docs/design/cpu-fast-paths.md#dtypes)."""
    weight_format: Annotated[PluginChoice, BeforeValidator(choice_shorthand)] = PluginChoice(name="auto")
    """The ``weight_format`` plugin that reads the checkpoint's weights, kept packed: ``auto`` takes the first that
    reads it (``gguf``, ``gptq``, ``awq``, ``compressed-tensors``; a float checkpoint runs in ``dtype``); ``int8``,
    ``w8a8`` or ``int4`` re-quantize a float one (docs/plugin-kinds/weight-format.md)."""
    max_model_len: PositiveInt | None = None
    """Longest prompt plus output, in tokens. Null: the model's ``max_position_embeddings`` (a model that
    declares none needs this set); a larger value is capped to it."""
    max_logprobs: int = Field(default=20, ge=-1)
    """Most ``logprobs`` / ``prompt_logprobs`` a request may ask for per position, as vLLM's; ``-1``: the whole
    vocabulary. A request asking for more is refused when it is added."""
    architecture: Choice = PluginChoice(name="auto")
    """The architecture plugin that builds the model, as ``{name, options}`` or its name alone
    (``patchbay plugins --kind architecture`` lists each one's Hugging Face architectures). ``auto``: the
    highest-priority plugin serving the model's ``config.json`` ``architectures`` name on this device, dtype and
    tensor-parallel size; a named plugin that cannot serve it is an error with its reasons."""

    _home = field_validator("path")(lambda value: _expand_home(value))

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("quantization") == "none":
            data = {**data, "quantization": "auto"}
        return renamed_keys(data, "model", {"quantization": "weight_format"})


class RuntimeSettings(Section):
    """The device, the CPU kernels and how the model is spread over processes."""

    device: str = "auto"
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda``, ``cuda:1``, ... Asking for CUDA where
    there is none is an error."""
    threads: PositiveInt | None = None
    """``torch.set_num_threads``. Null: torch's default; with several ranks or pipeline stages, the cores this
    process may use, shared evenly by the ranks on this machine."""
    linear_kernel: Literal["auto", "tiles", "onednn", "row_split", "torch"] = "auto"
    """The kernel of linear layers on the CPU (docs/design/cpu-fast-paths.md#linear-kernels). ``auto``: what the
    machine's tuning measured fastest for the run's dtype; a kernel named for a dtype or device it cannot run is
    an error."""
    fuse_projections: bool = True
    """Compute each layer's q/k/v projections (and gate/up) as one product over their concatenated weights, in
    steps of up to as many rows as the machine's tuning measured faster (16 without a tuning). Off with a ``lora:``
    section, whose adapters add to each projection's own output."""
    cpu_allocator: Literal["caching", "system"] = "caching"
    """Where torch's CPU tensors come from, for the whole process (the first engine's choice holds):
    ``caching``, patchbay's cache of freed blocks by size class (up to 512 MiB kept), built like the C++ kernels,
    so a step's temporaries skip the C library's search (docs/design/cpu-fast-paths.md#host-allocator);
    ``system``, the C library's allocator."""
    fused_ops: bool = True
    """Run Llama-style RMS norms, SiLU MLPs, rotary embeddings (Qwen3's q/k norms, Phi-3's fused projections and
    Gemma's norms, tanh-GELU MLPs and attention too) and, where all of a Llama-shaped layer fused, whole decoder
    layers through patchbay's C++ kernels on CPU float32 and bfloat16. Without a C++ compiler nothing changes
    (docs/design/cpu-fast-paths.md#fused-kernels). With a ``lora:`` section whole layers do not fuse."""
    single_thread_max_tokens: NonNegativeInt | Literal["auto"] = "auto"
    """Steps of at most this many tokens run torch's ops on one CPU thread, where waking a second costs more than
    it gains (tiled products and the decode kernel keep their own awake helpers). ``auto``: up to the row count
    the machine's tuning measured faster for the run's dtype (0 without a tuning); 0: never."""
    seed: int = 0
    """``torch.manual_seed`` at engine start and again once the engine is built, on every rank and stage, so
    random samplers repeat run to run whatever the rank count."""
    tensor_parallel_size: PositiveInt = 1
    """Ranks the model is split over, one process each (the architectures whose plugin declares it: ``patchbay
    plugins --kind architecture``): attention heads and
    ``intermediate_size`` must be divisible by it, KV heads must divide it or be divisible by it. Under
    ``torchrun``, ``WORLD_SIZE`` must equal it times ``pipeline_parallel_size`` (docs/design/parallelism.md)."""
    pipeline_parallel_size: PositiveInt = 1
    """Pipeline stages the decoder layers are split over, one process each; only the last stage computes logits.
    At most one stage per layer, and every stage must hold each kind of attention layer the model has
    (docs/design/parallelism.md#pipeline-stages)."""
    pipeline_layer_partition: Annotated[list[PositiveInt] | None, NoDecode] = None
    """Decoder layers of each stage, in stage order (``[19, 11]``, or ``19,11`` on the command line): one entry
    per stage, adding up to the model's layers. Null: an even split, the first stages one more. The last stage
    also computes the logits."""
    distributed_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The torch.distributed backend joining the ranks: ``auto`` is NCCL on CUDA (rank ``r`` on the ``r``-th
    device) and gloo on the CPU; ``nccl`` on the CPU is an error."""
    distributed_timeout: PositiveFloat = 300.0
    """Seconds a collective waits for a rank that is alive but silent before the run fails; a rank whose process
    ended fails the run at once."""
    master_addr: str | None = None
    """Rank 0's address as the other ranks reach it (the run's store and step channel). Null: torchrun's
    ``MASTER_ADDR`` under torchrun, else the loopback interface (``127.0.0.1``)."""
    master_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    """Port of the run's torch.distributed store. Null: torchrun's ``MASTER_PORT`` under torchrun, else a free
    port; another port under torchrun makes rank 0 host a store of its own."""
    data_parallel_size: PositiveInt = 1
    """Replicas of the whole engine ``patchbay serve`` starts, one process each on its share of this process's
    cores, behind one router (the ``router:`` section, docs/fleet.md). Each replica may itself be split over
    ``tensor_parallel_size`` ranks."""
    data_parallel_rank: NonNegativeInt = 0
    """Which replica this process is; ``patchbay serve`` sets it for the replicas it starts. It offsets the
    KV-event ports and labels the ``vllm:`` metrics' ``engine``."""

    _partition = field_validator("pipeline_layer_partition", mode="before")(
        lambda value: _split_names(value) if isinstance(value, str) else value
    )

    @model_validator(mode="after")
    def _one_partition_per_stage(self) -> RuntimeSettings:
        partition = self.pipeline_layer_partition
        if partition is not None and len(partition) != self.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_layer_partition gives {len(partition)} stages' layers "
                f"({','.join(map(str, partition))}); pipeline_parallel_size is {self.pipeline_parallel_size}"
            )
        return self

    @model_validator(mode="after")
    def _rank_within_replicas(self) -> RuntimeSettings:
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {self.data_parallel_rank} is not below data_parallel_size "
                f"{self.data_parallel_size}"
            )
        return self

    @property
    def world_size(self) -> int:
        """Processes the run's model is spread over: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class CacheSettings(Section):
    """The paged KV cache. The pool must hold one request of ``model.max_model_len`` tokens, and it
    must fit the memory free when the engine starts (docs/design/kv-cache.md)."""

    block_size: PositiveInt = 16
    """Tokens per KV-cache block."""
    num_blocks: PositiveInt | None = None
    """Size the KV pool by block count (block 0 is reserved); give this or ``memory``, not both."""
    memory: Annotated[int | Literal["auto"], BeforeValidator(_byte_size_or_auto)] = "auto"
    """Size the pool by a budget (``512MiB``, ``2GB``, a number of bytes). ``auto``: ``memory_utilization`` of
    the device's memory less the loaded model and the measured peak of the largest step
    (docs/design/kv-cache.md#sizing-the-pool)."""
    memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """The share of the device's memory (the machine's or its cgroup's, on the CPU) ``memory: auto`` may fill,
    the model included. Null: 0.9 on a GPU, 0.5 on the CPU, whose memory the rest of the machine shares."""
    prefix_caching: bool = True
    """Share full blocks of identical prompt prefixes between requests."""
    dtype: Literal["auto", "int8"] = "auto"
    """``auto``: keys and values in the model's dtype. ``int8``: each token's features per KV head rounded to
    int8 with a float32 scale, about a quarter of float32's bytes (docs/design/kv-cache.md#int8-cache); the
    attention backend must support it."""

    @model_validator(mode="after")
    def _one_sizing(self) -> CacheSettings:
        if self.num_blocks is not None and self.memory != "auto":
            raise ValueError("give either num_blocks or memory, not both")
        return self


class KVEventsSettings(Section):
    """KV-cache events for routers and indexes outside the engine: every block entering or leaving the prefix
    cache, published over ZMQ in vLLM's ``KVEventBatch`` format, as vLLM's ``kv_events_config``
    (docs/fleet.md#kv-cache-events)."""

    enable_kv_cache_events: bool = False
    """Publish the events (needs ``cache.prefix_caching``)."""
    endpoint: str = "tcp://127.0.0.1:5557"
    """The ZMQ PUB socket's address, which patchbay binds (``tcp://*:5557``: every interface; the events
    carry prompt tokens). Replica ``r`` adds ``r`` to the port, as vLLM's data-parallel ranks do."""
    replay_endpoint: str | None = None
    """A ZMQ ROUTER address (bound, port offset by the replica too) where a subscriber that missed batches asks
    for them again from a sequence number. Null: no replay."""
    buffer_steps: PositiveInt = 10_000
    """Batches kept for replay."""
    hwm: PositiveInt = 100_000
    """The PUB socket's high-water mark: batches queued for slow subscribers before ZMQ drops theirs."""
    max_queue_size: PositiveInt = 100_000
    """Batches waiting for the publisher thread; past it the engine's step waits."""
    topic: str = ""
    """The topic frame of every message (subscribers filter on its prefix)."""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _tcp_endpoint(cls, value: str | None) -> str | None:
        if value is None or value.startswith(("ipc://", "inproc://")):
            return value
        host, _, port = value.removeprefix("tcp://").rpartition(":")
        if not value.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r} is not a ZMQ endpoint like tcp://127.0.0.1:5557 (or ipc://PATH)")
        return value


class SchedulerSettings(Section):
    """How many requests and tokens one step batches."""

    max_num_seqs: PositiveInt = 64
    """Most requests running at once."""
    max_num_batched_tokens: PositiveInt = 2048
    """Token budget of one step: prefill chunks plus decodes."""
    chunked_prefill: bool = True
    """Split long prompts across steps. When off, a prompt must fit the token budget whole; a longer one is
    rejected."""
    max_n: PositiveInt = 1024
    """Most sequences one request may ask for (its ``n``) in ``LLM.generate`` and ``patchbay run``: each sequence
    is a request of its own, built when the request is added, so a larger ``n`` is refused up front, naming the
    request.  The server bounds ``n`` by ``scheduler.max_num_seqs + server.max_waiting`` instead."""
    max_num_encoder_input_tokens: PositiveInt = 8192
    """Encoder budget of one step, for vision-language models: the placeholder tokens of the images whose encoder
    runs in it. An image is encoded whole in the step whose chunk first reaches it; when the budget cannot take
    it, the chunk stops before the image. A request with an image larger than this is refused."""
    encoder_cache_size: PositiveInt = 8192
    """Capacity of the encoder cache, in placeholder tokens: encoded images stay there, shared by identical
    images; once no request needs one it stays until a new image needs its room (least recently released
    first). A chunk whose image does not fit stops before it; a larger image is refused. ``cache.memory: auto``
    reserves it full (docs/design/multimodal.md)."""
