"""``patchbay run`` on a pooling engine: job lines in, one vector per line out (embeddings, probabilities, scores).

A line is a text, or an object with one of ``input`` (a text or token ids), ``prompt`` or ``prompt_token_ids``,
and optionally ``id``, ``dimensions``, ``normalize``, ``activation`` and ``token_type_ids``.  A cross-encoder's
lines (pooler ``score``) may instead give a pair, ``text_1`` and ``text_2``.  Texts are embedded as they are:
``inputs.chat_template`` applies to generation only.  Results are ``{"id", "num_prompt_tokens"}`` with the vector
under ``embedding``, ``probs`` or ``score``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, NamedTuple, TextIO

from patchbay.contract.settings import ConfigError, ConfigProblem, Settings
from patchbay.engine import EngineDeadError
from patchbay.entrypoints.pooling import PoolingOutput, PoolingPrompt, pool, tokenize_input, tokenize_pair
from patchbay.entrypoints.result_file import ResultFile, ResultsNotWritten, check_output_path
from patchbay.entrypoints.run_command import REQUESTS_FAILED, job_items
from patchbay.interfaces import PoolingParams

_INPUT_KEYS = ("input", "prompt", "prompt_token_ids")
_PARAM_KEYS = ("dimensions", "normalize", "activation")


class PoolingJobLine(NamedTuple):
    """One line of a pooling job, tokenized, and where it was written."""

    request_id: str
    prompt: PoolingPrompt
    params: PoolingParams
    where: str


def read_pooling_job(settings: Settings, config_path: str | None, engine: Any) -> list[PoolingJobLine]:
    """Every line parsed, tokenized and checked against the pooling ``engine``; errors name the file and line at
    fault, all at once."""
    run = engine.pooling
    lines: list[PoolingJobLine] = []
    problems: list[ConfigProblem] = []
    seen: set[str] = set()
    for where, default_id, item in job_items(settings, config_path):
        try:
            line = _parse(item, where, default_id, engine.tokenizer, run.task)
            engine.check_pooling_request(
                line.request_id, line.prompt.token_ids, line.params, line.prompt.token_type_ids
            )
        except ValueError as exc:
            problems.append(ConfigProblem(where, "<request>", str(exc)))
            continue
        if line.request_id in seen:
            problems.append(ConfigProblem(where, "id", f"duplicate request id {line.request_id!r}"))
        seen.add(line.request_id)
        lines.append(line)
    if problems:
        raise ConfigError(problems)
    return lines


def _parse(item: Any, where: str, default_id: str, tokenizer: Any, task: str) -> PoolingJobLine:
    if isinstance(item, str):
        return PoolingJobLine(default_id, tokenize_input(tokenizer, item, where), PoolingParams(), where)
    if not isinstance(item, dict):
        raise ValueError(f"expected a string or an object, got {type(item).__name__}")
    request_id = item.get("id", default_id)
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise ValueError(f"a request id is a string or an integer, got {request_id!r}")
    unknown = set(item) - {"id", "token_type_ids", "text_1", "text_2", *_INPUT_KEYS, *_PARAM_KEYS}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    params = PoolingParams(**{key: item[key] for key in _PARAM_KEYS if key in item})
    if "text_1" in item or "text_2" in item:
        if task != "score":
            raise ValueError(f"text_1 and text_2 pairs need a cross-encoder (pooler task score); this run's is {task}")
        first, second = item.get("text_1"), item.get("text_2")
        if not isinstance(first, str) or not isinstance(second, str):
            raise ValueError("text_1 and text_2 are both strings")
        prompt = tokenize_pair(tokenizer, first, second, where)
        return PoolingJobLine(str(request_id), prompt, params, where)
    given = [key for key in _INPUT_KEYS if key in item]
    if len(given) != 1:
        raise ValueError("needs exactly one of 'input', 'prompt', 'prompt_token_ids' (or a text_1, text_2 pair)")
    (key,) = given
    raw = item[key] if key != "prompt_token_ids" else {"prompt_token_ids": item[key]}
    if key == "prompt_token_ids" and "token_type_ids" in item:
        raw["token_type_ids"] = item["token_type_ids"]
    return PoolingJobLine(str(request_id), tokenize_input(tokenizer, raw, where), params, where)


def run_pooling_job(settings: Settings, *, config_path: str | None = None, stream: TextIO | None = None) -> int:
    """Run a pooling job; the exit status of ``patchbay run`` (``REQUESTS_FAILED`` when some lines failed)."""
    from patchbay.entrypoints.llm import LLM

    stream = stream or sys.stdout
    output_path = settings.outputs.path
    if output_path is not None:
        check_output_path(output_path, config_path or "<settings>")
    llm = LLM(settings)
    run = llm.engine.pooling
    assert run is not None, "a pooling: section builds a pooling engine"
    lines = read_pooling_job(settings, config_path, llm.engine)
    results = ResultFile(output_path) if output_path is not None else None

    def finished(output: PoolingOutput) -> None:
        if results is not None:
            results.write(output.as_dict(run.task))

    started = time.monotonic()
    error: str | None = None
    try:
        outputs = pool(
            llm.engine,
            [line.prompt for line in lines],
            [line.params for line in lines],
            [line.request_id for line in lines],
            on_finished=finished,
        )
    except (EngineDeadError, ResultsNotWritten) as exc:
        error = str(exc)
        print(f"patchbay: error: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise
    finally:
        if results is not None:
            results.close(error, num_requests=len(lines))
    elapsed = time.monotonic() - started
    tokens = sum(output.num_prompt_tokens for output in outputs)
    report = llm.engine.report()
    print(f"requests:            {len(outputs)} ({run.task} with pooler:{run.pooler_name})", file=stream)
    print(f"prompt tokens:       {tokens}", file=stream)
    print(f"wall time:           {elapsed:.2f} s", file=stream)
    print(f"throughput:          {len(outputs) / elapsed:.1f} inputs/s, {tokens / elapsed:.1f} tok/s", file=stream)
    print(
        f"engine:              {report.stats.num_steps} steps, attention {report.attention_backend}, "
        f"{report.dtype} on {report.device}",
        file=stream,
    )
    if results is not None:
        print(f"results:             {output_path}", file=stream)
    failed = [output for output in outputs if output.error is not None]
    if failed:
        print(
            f"patchbay: {len(failed)} of {len(outputs)} requests failed; the first: request "
            f"{failed[0].request_id!r}: {failed[0].error}",
            file=sys.stderr,
        )
        return REQUESTS_FAILED
    return 0
