"""The sections around the engine: images in prompts, ``patchbay run``'s inputs and outputs, and ``patchbay
serve``'s server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator
from pydantic_settings import NoDecode

from patchbay.contract.settings.sections import Section, _expand_home, _split_names


class MultimodalSettings(Section):
    """How images in prompts are read and bounded: counts, sizes, and which local files and remote URLs may be
    read (docs/serving.md#images)."""

    max_images_per_prompt: PositiveInt = 8
    """Most images one prompt (one chat request, one offline prompt) may carry; more is an error naming the
    request."""
    max_image_pixels: PositiveInt = 16_777_216
    """Most pixels (width × height) of one image, checked from its header before it is decoded, so a small file
    that would decode to a huge bitmap (a decompression bomb) is refused first."""
    max_image_bytes: PositiveInt = 20 << 20
    """Largest encoded image read from a ``data:`` URL, a ``file://`` URL or a remote URL, in bytes."""
    allowed_local_media_path: Path | None = None
    """The folder ``file://`` image URLs may read from (symlinks and ``..`` leading out of it are refused);
    null: ``file://`` URLs are refused. Plain paths given to the offline API are read wherever they are."""
    allow_remote_urls: bool = False
    """Fetch ``http://`` and ``https://`` image URLs; off by default, since the server would then fetch any
    address a client names (its own network included)."""
    remote_fetch_timeout: PositiveFloat = 10.0
    """Seconds a remote image may take to connect and to send each piece before the fetch fails."""
    decode_threads: PositiveInt = 2
    """Threads ``patchbay serve`` reads, decodes and processes images on, apart from the ones that tokenize, so
    images never hold up text requests; more images wait their turn."""
    max_decoded_bytes_in_flight: PositiveInt = 1 << 30
    """Bytes of images ``patchbay serve`` holds for requests in flight: 4 per pixel decoded (read from the
    headers, before decoding) plus the processed pixels. A request past it gets 503 before its images are
    decoded; one that never fits gets 400."""
    load_timeout: PositiveFloat = 30.0
    """Seconds ``patchbay serve`` gives one image to be read (a file, a remote URL) and decoded; past it the
    request fails with 503 naming the part."""

    _home = field_validator("allowed_local_media_path")(lambda value: _expand_home(value))

    @field_validator("allowed_local_media_path")
    @classmethod
    def _folder_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_dir():
            raise ValueError(f"no folder at {value}")
        return value


class InputSettings(Section):
    """The requests ``patchbay run`` runs; ``prompts`` and ``file`` may both be given, and a run
    without either is an error."""

    prompts: list[str | dict[str, Any]] = Field(default_factory=list)
    """Inline requests: strings, or objects with ``prompt``, ``messages`` or ``prompt_token_ids`` and
    per-request sampling parameters (docs/configuration.md#requests)."""
    file: Path | None = None
    """A JSONL file of request objects, one per line, run after the inline ones; a relative path is relative to
    the YAML file's directory."""
    chat_template: bool = True
    """Send plain-string prompts as a user message through the tokenizer's chat template (an error if it has
    none)."""
    sampling: dict[str, Any] = Field(default_factory=dict)
    """Default sampling parameters of every request (``max_tokens``, ``stop``, ...); a request's own keys
    override them."""

    _home = field_validator("file")(lambda value: _expand_home(value))


class OutputSettings(Section):
    """Where ``patchbay run`` writes its results."""

    path: Path | None = None
    """Where ``patchbay run`` writes one JSON line per finished request; null: nowhere. Relative to the current
    directory, not the YAML file's; missing directories are created (docs/configuration.md#results)."""
    progress: bool = True
    """Show a progress bar of finished requests on stderr."""

    _home = field_validator("path")(lambda value: _expand_home(value))


class ServerSettings(Section):
    """Where ``patchbay serve`` listens, who may call it and how much it queues
    (docs/serving.md)."""

    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` for every interface)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port (0: any free port, printed at start)."""
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Accepted ``Authorization: Bearer`` keys; empty: no key needed. A comma-separated string works too (handy
    in ``PATCHBAY_SERVER__API_KEYS``)."""
    api_key_file: Path | None = None
    """A file of more accepted keys, one per line (blank lines and ``#`` comments skipped), readable by its owner
    alone (else the server refuses to start, naming it). With ``PATCHBAY_SERVER__API_KEYS``, the way to keep keys
    off the command line."""
    served_model_name: str | None = None
    """The model name clients send; default: the model directory's name."""
    max_waiting: int = Field(default=256, ge=0)
    """Sequences admitted beyond ``scheduler.max_num_seqs``; a request over the limit gets 503 instead of an
    unbounded queue."""
    stored_responses: int = Field(default=256, ge=0)
    """Responses kept in memory per API key for ``previous_response_id`` and ``GET /v1/responses/{id}`` (least
    recently used dropped first; 0: none kept). Only the key that made one reads it. A request with
    ``store: false`` is never kept."""
    stored_response_bytes: int = Field(default=64 << 20, ge=0)
    """Bytes of stored responses and their conversations kept per API key (least recently used dropped first);
    a larger one is not kept."""
    shutdown_grace_period: float = Field(default=30.0, ge=0.0)
    """Seconds after SIGTERM during which requests in flight may finish; the rest are aborted."""
    log_requests: bool = True
    """Log one line per HTTP request (uvicorn's access log: client, request line, status)."""
    stats_interval: float = Field(default=10.0, ge=0.0)
    """Seconds between the log lines of the engine's load (throughput, requests running and waiting, KV-cache
    use, prefix-cache hit rate); none while the server is idle; 0: never."""
    max_body_bytes: int = Field(default=32 << 20, ge=1)
    """Largest request body; a larger one gets 413 before it is read whole."""
    idle_timeout: float = Field(default=5.0, gt=0.0)
    """Seconds a kept-alive connection may sit idle between requests before it is closed."""
    header_timeout: float = Field(default=10.0, gt=0.0)
    """Seconds a request's headers may take to arrive (from the connection's start or, kept alive, after
    ``idle_timeout``); a connection that sends nothing or trickles them is closed."""
    min_body_rate: int = Field(default=16 << 10, ge=1)
    """Bytes per second a request body must keep up, after a first ``header_timeout`` seconds of grace; a body
    trickled slower has its connection closed."""
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """``Host`` names accepted besides ``localhost``/``127.0.0.1``/``::1`` while ``host`` is a loopback address
    (``*``: any); others get 400, so a DNS-rebound web page cannot call the server."""

    _split = field_validator("api_keys", "allowed_hosts", mode="before")(_split_names)
    _home = field_validator("api_key_file")(lambda value: _expand_home(value))


class RouterSettings(Section):
    """The router ``patchbay serve`` puts in front of its replicas when ``runtime.data_parallel_size`` is above 1:
    vLLM's router (``vllm-router``, Rust, from PyPI), started and supervised by patchbay (docs/fleet.md)."""

    policy: Literal["cache_aware", "kv_aware", "round_robin", "power_of_two", "consistent_hash", "random"] = (
        "cache_aware"
    )
    """How the router picks a replica. ``cache_aware``: the replica whose past requests share the longest token
    prefix with this one, unless the load is too uneven; ``kv_aware``: the replica whose KV-cache events say it
    holds the longest prefix (turns on ``kv_events`` for the replicas); the others ignore the prefix."""
    executable: str = "vllm-router"
    """The router's program: a path, or a name looked up beside this Python's interpreter, then on ``PATH``."""
    replica_host: str = "127.0.0.1"
    """Address the replicas listen on (the router reaches them there)."""
    replica_ports: Annotated[list[Annotated[int, Field(ge=1, le=65535)]], NoDecode] = Field(default_factory=list)
    """One HTTP port per replica, in rank order (``8101,8102``); empty: free ports picked at start."""
    health_check_interval: PositiveInt = 1
    """Seconds between the router's health checks of each replica; it stops sending to a replica after one
    failed check and sends again after one passed check."""
    restart_delay: PositiveFloat = 1.0
    """Seconds before a replica that died is started again; doubled after each death within a minute of its
    start, up to 60."""
    startup_timeout: PositiveFloat = 600.0
    """Seconds the replicas may take to load their model and answer ``/health`` before ``patchbay serve`` gives
    up."""
    prefill_replicas: int = Field(default=0, ge=0)
    """Disaggregated prefill: the first this many replicas prefill (their ``kv_connector`` a producer) and the
    others decode (consumers), paired by the router's prefill/decode mode; needs a ``kv_connector:`` section
    whose store both sides reach. 0: every replica does both."""
    extra_args: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """More arguments for the router's command line, passed as they are (``--log-level,debug``)."""

    _split = field_validator("replica_ports", "extra_args", mode="before")(_split_names)
