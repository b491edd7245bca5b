"""``patchbay run CONFIG``: read requests, generate, write JSONL results, print a summary."""

from __future__ import annotations

import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

from pydantic import ValidationError

from patchbay.contract.settings import ConfigError, ConfigProblem, Settings
from patchbay.engine import EngineDeadError, RequestOutput
from patchbay.engine import MultiModalInputError, ProcessedImages, check_num_sequences
from patchbay.entrypoints.result_file import ResultFile, ResultsNotWritten, check_output_path
from patchbay.multimodal.images import ImageInputError
from patchbay.sampling_params import SamplingParams

if TYPE_CHECKING:
    from patchbay.engine import Engine

_REQUEST_KEYS = {"id", "prompt", "messages", "prompt_token_ids", "multi_modal_data"}


class JobRequest(NamedTuple):
    """One request of a job, and where it was written (``job.yaml: inputs.prompts.3``, ``requests.jsonl:12``)."""

    request_id: str
    prompt: Any
    params: SamplingParams
    where: str


def read_requests(settings: Settings, config_path: str | None) -> list[tuple[str, Any, SamplingParams]]:
    """The run's requests as ``(id, prompt, sampling params)``; errors name the file, line or index at fault."""
    return [(request.request_id, request.prompt, request.params) for request in read_job(settings, config_path)]


def read_job(settings: Settings, config_path: str | None) -> list[JobRequest]:
    """:func:`read_requests` with where each request was written, to name it in later errors."""
    requests = []
    seen: set[str] = set()
    for where, default_id, item in job_items(settings, config_path):
        request_id, prompt, params = _parse_item(item, where, default_id, settings)
        if request_id in seen:
            raise ConfigError([ConfigProblem(where, "id", f"duplicate request id {request_id!r}")])
        seen.add(request_id)
        requests.append(JobRequest(request_id, prompt, params, where))
    return requests


def job_items(settings: Settings, config_path: str | None) -> list[tuple[str, str, Any]]:
    """The job's raw items as ``(where, default id, item)``: ``inputs.prompts``, then ``inputs.file``'s lines;
    errors name the file and line."""
    config_label = config_path or "<settings>"
    items: list[tuple[str, str, Any]] = []  # (where, default id, raw item)
    for index, item in enumerate(settings.inputs.prompts):
        items.append((f"{config_label}: inputs.prompts.{index}", str(index), item))
    if settings.inputs.file is not None:
        path = settings.inputs.file
        if not path.is_absolute() and config_path is not None:
            path = Path(config_path).parent / path
        try:
            lines = path.read_text().splitlines()
        except UnicodeDecodeError as exc:
            raise ConfigError(
                [ConfigProblem(config_label, "inputs.file", f"{path} is not UTF-8 text: {exc}")]
            ) from None
        except OSError as exc:
            raise ConfigError(
                [ConfigProblem(config_label, "inputs.file", f"cannot read {path}: {exc.strerror}")]
            ) from exc
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError([ConfigProblem(f"{path}:{number}", "<line>", f"not valid JSON: {exc.msg}")]) from exc
            items.append((f"{path}:{number}", f"{path.stem}-{number}", item))
    if not items:
        raise ConfigError([ConfigProblem(config_label, "inputs", "no requests: set inputs.prompts or inputs.file")])
    return items


def _parse_item(item: Any, where: str, default_id: str, settings: Settings) -> tuple[str, Any, SamplingParams]:
    if isinstance(item, str):
        prompt: Any = {"messages": [{"role": "user", "content": item}]} if settings.inputs.chat_template else item
        overrides: dict[str, Any] = {}
        request_id = default_id
    elif isinstance(item, dict):
        given = _REQUEST_KEYS & {"prompt", "messages", "prompt_token_ids"} & item.keys()
        if len(given) != 1:
            raise ConfigError(
                [ConfigProblem(where, "<request>", "needs exactly one of 'prompt', 'messages', 'prompt_token_ids'")]
            )
        (key,) = given
        prompt = {key: item[key]}
        if "multi_modal_data" in item:
            if key == "messages":
                raise ConfigError(
                    [
                        ConfigProblem(
                            where,
                            "multi_modal_data",
                            "goes with 'prompt' or 'prompt_token_ids' (one image marker per image); "
                            "'messages' carry their images as image_url or image parts",
                        )
                    ]
                )
            prompt["multi_modal_data"] = item["multi_modal_data"]
        overrides = {k: v for k, v in item.items() if k not in _REQUEST_KEYS}
        request_id = item.get("id", default_id)
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            raise ConfigError(
                [ConfigProblem(where, "id", f"a request id is a string or an integer, got {json.dumps(request_id)}")]
            )
        request_id = str(request_id)
    else:
        raise ConfigError(
            [ConfigProblem(where, "<request>", f"expected a string or an object, got {type(item).__name__}")]
        )
    try:
        params = SamplingParams.model_validate({**settings.inputs.sampling, **overrides})
    except ValidationError as exc:
        problems = [
            ConfigProblem(
                where,
                ".".join(str(p) for p in error["loc"]) or "<sampling>",
                "unknown key" if error["type"] == "extra_forbidden" else error["msg"],
            )
            for error in exc.errors()
        ]
        raise ConfigError(problems) from None
    return request_id, prompt, params


def _percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"p50 {values[0] * 1e3:.1f} ms"
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return f"p50 {cuts[49] * 1e3:.1f} ms, p90 {cuts[89] * 1e3:.1f} ms, p99 {cuts[98] * 1e3:.1f} ms"


def summarise(outputs: list[RequestOutput], elapsed: float, engine: Engine) -> str:
    """The end-of-run summary ``patchbay run`` prints, from the outputs and the engine's report."""
    report = engine.report()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(o.token_ids) for o in outputs)
    ttft = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    itl = [gap for o in outputs for gap in o.metrics.inter_token_latencies]
    reasons: dict[str, int] = {}
    for output in outputs:
        reasons[str(output.finish_reason)] = reasons.get(str(output.finish_reason), 0) + 1
    step_total = sum(report.step_timings.values()) or 1.0
    breakdown = ", ".join(
        f"{phase} {100 * seconds / step_total:.0f}%" for phase, seconds in report.step_timings.items()
    )
    paths, fused = report.linear_paths, report.fused_modules
    lines = [
        f"requests:            {len(outputs)} ({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))})",
        f"prompt tokens:       {prompt_tokens} ({sum(o.metrics.num_cached_tokens for o in outputs)} from prefix cache)",
        f"generated tokens:    {generated}",
        f"wall time:           {elapsed:.2f} s",
        f"throughput:          {generated / elapsed:.1f} generated tok/s, "
        f"{(prompt_tokens + generated) / elapsed:.1f} total tok/s",
        f"time to first token: {_percentiles(ttft)}",
        f"inter-token latency: {_percentiles(itl)}",
        f"engine:              {report.stats.num_steps} steps, {report.stats.num_preemptions} preemptions, "
        f"attention {report.attention_backend}, {report.dtype} on {report.device}, KV cache {report.kv_cache_dtype}",
        f"model:               architecture plugin {report.architecture}, {report.kv_bytes_per_token} KV bytes "
        "per token",
        f"step time:           {breakdown}",
    ]
    if report.machine_defaults is not None:
        lines.append(f"machine defaults:    {report.machine_defaults}")
    lines.append(f"heap:                {report.heap}")
    if report.kv_sizing is not None:
        lines.append(f"kv cache:            {report.kv_sizing}")
    lines.append(
        f"linears:             {paths.packed} packed as {paths.layout}, {paths.fused_groups} fused projection "
        f"groups, {paths.row_split} row-split, {report.quantized_linears} quantized; steps of up to "
        f"{report.single_thread_max_tokens} tokens on one thread"
    )
    lines.append(
        f"fused kernels:       {fused.norms} RMS norms, {fused.mlps} SiLU MLPs, {fused.attentions} "
        f"rotary attentions, {fused.layers} whole decoder layers, {fused.decoder_loops} decoder loops"
    )
    if report.kv_connector is not None:
        kv = report.kv_connector
        lines.append(
            f"kv connector:        {kv.num_loaded_tokens} tokens loaded, {kv.num_recomputed_blocks} blocks "
            f"recomputed after load errors"
        )
    grammars = report.grammars
    if grammars.num_compiled or grammars.num_failed or grammars.num_timed_out:
        longest = max(grammars.compile_seconds, default=0.0)
        lines.append(
            f"grammars:            {grammars.num_compiled} compiled (longest {longest:.2f} s), "
            f"{grammars.num_failed} failed, {grammars.num_timed_out} past structured_output.compile_timeout, "
            f"{grammars.num_cache_hits} cache hits"
        )
        slow = grammars.slow_compiles
        if slow or grammars.num_timed_out:
            lines.append(
                f"warning:             {len(slow) + grammars.num_timed_out} grammar compile(s) took "
                f"{grammars.slow_compile_seconds:g} s or more; constrained requests waited for them (the step time's "
                "compile phase)"
            )
    if report.encoder_cache is not None:
        images = report.encoder_cache
        lines.append(
            f"encoder cache:       {images.misses} images encoded ({images.encoded_tokens} tokens, "
            f"{report.step_timings.get('encoder', 0.0):.3f} s), {images.hits} served from the cache"
        )
    spec = report.spec_decode
    if spec.num_draft_tokens:
        per_position = ", ".join(f"{rate:.2f}" for rate in spec.acceptance_rate_per_position)
        lines.append(
            f"speculative:         {spec.num_draft_tokens} drafted, {spec.num_accepted_tokens} accepted "
            f"({100 * spec.acceptance_rate:.1f}%), per position [{per_position}], "
            f"mean accepted length {spec.mean_accepted_length:.2f}"
        )
    return "\n".join(lines)


class EncodedRequest(NamedTuple):
    """A checked request as the engine takes it: text, token ids, and its images processed (``None``: none)."""

    text: str | None
    token_ids: list[int]
    images: ProcessedImages | None


def check_requests(llm: Any, requests: list[JobRequest]) -> list[EncodedRequest]:
    """Every request encoded, its images loaded and processed, and checked against the loaded model; errors
    name the file and line at fault (and the image part: ``requests.jsonl:3: multi_modal_data.image[1]``)."""
    encoded = []
    problems = []
    for request in requests:
        try:
            try:
                text, token_ids, images = _encode_with_images(llm, request)
            except ImageInputError as exc:
                message = str(exc).removeprefix(f"{exc.where}: ")
                problems.append(ConfigProblem(request.where, exc.where, f"request {request.request_id!r}: {message}"))
                continue
            except MultiModalInputError:
                raise  # it names the request already
            except ValueError as exc:
                raise ValueError(f"request {request.request_id!r}: {exc}") from None
            check_num_sequences(request.request_id, request.params, llm.settings.scheduler.max_n)
            engine_ids = images.token_ids if images is not None else token_ids
            llm.engine.check_request(request.request_id, engine_ids, request.params)
        except ValueError as exc:
            problems.append(ConfigProblem(request.where, "<request>", str(exc)))
            continue
        encoded.append(EncodedRequest(text, token_ids, images))
    if problems:
        raise ConfigError(problems)
    return encoded


def _encode_with_images(llm: Any, request: JobRequest) -> tuple[str | None, list[int], ProcessedImages | None]:
    """A request's text and token ids, and its images (``multi_modal_data``, or image parts of ``messages``)
    decoded under the ``multimodal:`` limits and processed once."""
    from patchbay.entrypoints.chat import render_chat, template_messages
    from patchbay.entrypoints.chat_images import load_chat_images, refuse_images_for_text_model, split_image_parts
    from patchbay.multimodal.images import load_multi_modal_data

    prompt = request.prompt
    limits = llm.settings.multimodal
    engine = llm.engine
    data = None
    if isinstance(prompt, dict) and "multi_modal_data" in prompt:
        data = load_multi_modal_data(prompt["multi_modal_data"], limits=limits, where="multi_modal_data")
        text, token_ids = llm.encode({key: value for key, value in prompt.items() if key != "multi_modal_data"})
    elif isinstance(prompt, dict) and _has_content_parts(prompt.get("messages")):
        messages, parts = split_image_parts(template_messages(prompt["messages"]))
        if parts and engine.image_inputs is None:
            refuse_images_for_text_model(parts, Path(str(engine.model_dir)).name)
        text, token_ids = render_chat(llm.tokenizer, messages, tools=None, template=None)
        if parts:
            data = {"image": load_chat_images(parts, limits)}
    else:
        text, token_ids = llm.encode(prompt)
    if data is None or not data["image"]:
        return text, token_ids, None
    return text, token_ids, engine.process_images(request.request_id, token_ids, data)


def _has_content_parts(messages: Any) -> bool:
    """Whether ``messages`` is a list with a message whose content is a list of parts (maybe images)."""
    return isinstance(messages, list) and any(
        isinstance(message, dict) and isinstance(message.get("content"), list) for message in messages
    )


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that the finished results are kept like on Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated("terminated by SIGTERM")


REQUESTS_FAILED = 3
"""Exit status of ``patchbay run`` when the job ran to its end but some requests failed."""


def run_from_settings(settings: Settings, *, config_path: str | None = None, stream: TextIO | None = None) -> int:
    """Run the job ``settings`` describe; the exit status of ``patchbay run``.

    Every request is checked (against the model too) before results are
    written; results then go to a temporary file renamed over
    ``outputs.path`` at the end, also when the job stops early (Ctrl-C,
    SIGTERM, an engine error): then a last line records the error, and a
    complete earlier result file is kept (see :mod:`.result_file`).
    """
    from tqdm import tqdm

    from patchbay.entrypoints.llm import LLM

    stream = stream or sys.stdout
    if settings.pooling is not None:
        from patchbay.entrypoints.pooling_job import run_pooling_job

        return run_pooling_job(settings, config_path=config_path, stream=stream)
    requests = read_job(settings, config_path)
    output_path = settings.outputs.path
    if output_path is not None:
        check_output_path(output_path, config_path or "<settings>")
    llm = LLM(settings)
    encoded = check_requests(llm, requests)
    results = ResultFile(output_path) if output_path is not None else None
    progress = tqdm(
        total=len(requests), desc="requests", unit="req", disable=not settings.outputs.progress, file=sys.stderr
    )

    def finished(output: RequestOutput) -> None:
        progress.update(1)
        if results is not None:
            results.write(output.as_dict())

    started = time.monotonic()
    own_sigterm = (
        threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    )
    previous_handler = signal.signal(signal.SIGTERM, _raise_terminated) if own_sigterm else None
    error: str | None = None
    try:
        prompts = [
            {"prompt_token_ids": request.token_ids, "prompt": request.text}
            | ({"multi_modal_data": request.images} if request.images is not None else {})
            for request in encoded
        ]
        outputs = llm.generate(
            prompts, [r.params for r in requests], request_ids=[r.request_id for r in requests], on_finished=finished
        )
    except EngineDeadError as exc:
        error = str(exc)
        print(f"patchbay: error: {exc}", file=sys.stderr)
        return 1
    except ResultsNotWritten as exc:
        error = str(exc)
        print(f"patchbay: error: {exc}", file=sys.stderr)
        return 1
    except _Terminated:
        error = "terminated by SIGTERM"
        kept = results.destination(stopped=True) if results is not None else None
        print(f"patchbay: {error}" + (f"; finished results kept in {kept}" if kept else ""), file=sys.stderr)
        return 128 + signal.SIGTERM
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        progress.close()
        if results is not None:
            results.close(error, num_requests=len(requests))
    elapsed = time.monotonic() - started
    for output in outputs[:8]:
        text = output.text.replace("\n", " ")
        print(f"[{output.request_id}] {text[:200]}", file=stream)
    if len(outputs) > 8:
        print(f"... {len(outputs) - 8} more", file=stream)
    print("\n" + summarise(outputs, elapsed, llm.engine), file=stream)
    if results is not None:
        print(f"results:             {output_path}", file=stream)
    failed = [output for output in outputs if output.finish_reason == "error"]
    if failed:
        # Every other request completed and is written; the exit status still tells a script that some did not.
        print(
            f'patchbay: {len(failed)} of {len(outputs)} requests failed (finish_reason "error"); the first: '
            f"request {failed[0].request_id!r}: {failed[0].error}",
            file=sys.stderr,
        )
        return REQUESTS_FAILED
    return 0
