"""``patchbay serve`` on a loopback port, driven by the official ``openai`` client and by raw HTTP.

One server (a tiny random Llama, the bundled tokenizer) serves the whole
module; its outputs are checked against :class:`patchbay.LLM` on the same
settings, the offline path every other test checks against transformers.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from serving import RunningServer, running_server

import patchbay
from patchbay import SamplingParams
from patchbay.contract.settings import load_settings
from patchbay.engine import AsyncLLM, EngineDeadError

API_KEY = "sk-patchbay-test"
MAX_NUM_SEQS = 16
MAX_WAITING = 16
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fibonacci(n):"]
MESSAGES = [{"role": "user", "content": "What is 12 times 12?"}]


def serve_settings(model_dir, *extra: str):
    return load_settings(
        None,
        overrides=[
            f"model.path={model_dir}",
            "cache.num_blocks=256",
            f"scheduler.max_num_seqs={MAX_NUM_SEQS}",
            f"server.max_waiting={MAX_WAITING}",
            f"server.api_keys=[{API_KEY}]",
            "server.served_model_name=tiny",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def server(tiny_llama) -> RunningServer:
    with running_server(serve_settings(tiny_llama)) as running:
        yield running


@pytest.fixture(scope="module")
def offline(tiny_llama) -> patchbay.LLM:
    return patchbay.LLM(serve_settings(tiny_llama))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server: RunningServer, path: str, body: dict, *, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


# -- outputs match the offline engine ---------------------------------------------------------------------


def test_greedy_completions_are_those_of_llm_generate(client, offline):
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    response = client.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [choice.text for choice in sorted(response.choices, key=lambda c: c.index)] == [o.text for o in expected]
    assert all(choice.finish_reason == "length" for choice in response.choices)
    assert response.usage.completion_tokens == 12 * len(PROMPTS)
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)


def test_a_streamed_batch_of_prompts_interleaves_its_choices_by_index(client, offline):
    expected = offline.generate(PROMPTS[:2], SamplingParams(max_tokens=10, ignore_eos=True))
    texts = ["", ""]
    finish = [None, None]
    for chunk in client.completions.create(
        model="tiny", prompt=PROMPTS[:2], max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [o.text for o in expected] and finish == ["length", "length"]


def test_streamed_greedy_chat_is_the_offline_text_in_pieces(client, offline):
    (expected,) = offline.generate({"messages": MESSAGES}, SamplingParams(max_tokens=20, ignore_eos=True))
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 5, "the answer should arrive in many chunks"
    assert "".join(pieces) == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 20
    assert usage.prompt_tokens == len(expected.prompt_token_ids)


def test_non_streamed_chat_reports_usage_and_cached_prompt_tokens(client, offline):
    long_messages = [{"role": "user", "content": "Tell me a long story about a dragon. " * 6}]
    first = client.chat.completions.create(model="tiny", messages=long_messages, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=long_messages, max_tokens=4, temperature=0)
    text, token_ids = offline.encode({"messages": long_messages})
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == len(token_ids)
    assert first.usage.total_tokens == len(token_ids) + first.usage.completion_tokens
    # The second request finds the first one's full blocks in the prefix cache (never the last token).
    block_size = 16
    assert again.usage.prompt_tokens_details.cached_tokens == (len(token_ids) - 1) // block_size * block_size
    assert first.choices[0].message.content == again.choices[0].message.content


def test_seeded_sampling_is_reproducible_and_matches_offline(client, offline):
    body = dict(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    first = client.completions.create(**body).choices[0].text
    second = client.completions.create(**body).choices[0].text
    (expected,) = offline.generate(PROMPTS[1], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234))
    assert first == second == expected.text
    other = client.completions.create(**{**body, "seed": 99}).choices[0].text
    assert other != first


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_those_of_offline_n(client, offline, stream: bool):
    (expected,) = offline.generate(
        PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    )
    body = dict(
        model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=5, n=3, extra_body={"ignore_eos": True}
    )
    if stream:
        texts = ["", "", ""]
        for chunk in client.completions.create(**body, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
    else:
        texts = [c.text for c in sorted(client.completions.create(**body).choices, key=lambda c: c.index)]
    assert texts == [c.text for c in expected.completions]
    assert len(set(texts)) > 1


def test_a_stop_string_split_across_stream_chunks_ends_the_text_before_it(client, offline):
    (reference,) = offline.generate(PROMPTS[2], SamplingParams(max_tokens=16, ignore_eos=True))
    pieces = [offline.tokenizer.decode([t]) for t in reference.token_ids]
    # A stop string made of the end of token 6 and the start of token 7: it only shows across two chunks.
    index = next(i for i in range(5, 15) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[index][-2:] + pieces[index + 1][:2]
    (expected,) = offline.generate(PROMPTS[2], SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))
    assert expected.finish_reason == "stop" and stop not in expected.text
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[2],
            max_tokens=16,
            temperature=0,
            stop=[stop],
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len([c for c in chunks if c.choices[0].text]) > 2


def test_logprobs_are_the_offline_ones(client, offline):
    (expected,) = offline.generate(PROMPTS[0], SamplingParams(max_tokens=5, logprobs=2, ignore_eos=True))
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    (expected_chat,) = offline.generate(
        {"messages": [{"role": "user", "content": PROMPTS[0]}]},
        SamplingParams(max_tokens=5, logprobs=2, ignore_eos=True),
    )
    content = response.choices[0].logprobs.content
    assert [round(item.logprob, 4) for item in content] == [round(e.logprobs[0], 4) for e in expected_chat.logprobs]
    assert all(len(item.top_logprobs) == 2 for item in content)
    completion = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    logprobs = completion.choices[0].logprobs
    assert [round(v, 4) for v in logprobs.token_logprobs] == [round(e.logprobs[0], 4) for e in expected.logprobs]
    assert "".join(logprobs.tokens) == completion.choices[0].text


def test_response_format_json_schema_constrains_the_chat_as_offline_structured_output_does(server, client, offline):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    (expected,) = offline.generate(
        {"messages": MESSAGES}, SamplingParams(max_tokens=40, structured_output={"json_schema": schema})
    )
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    assert reply.choices[0].message.content == expected.text
    if reply.choices[0].finish_reason == "stop":  # the grammar finished (a random model may ramble in whitespace)
        assert json.loads(expected.text)["answer"] in ("yes", "no")
    bad = post(
        server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "response_format": {"type": "xml"}}
    )
    assert bad.status_code == 400 and error_of(bad)["param"] == "response_format.type"


# -- the other routes -------------------------------------------------------------------------------------


def test_models_health_ready_tokenize_detokenize(server, client, offline):
    assert [model.id for model in client.models.list()] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200
    tokens = post(server, "/tokenize", {"prompt": "Hello there"}).json()
    assert tokens["tokens"] == offline.tokenizer.encode("Hello there") and tokens["count"] == len(tokens["tokens"])
    chat = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert chat["tokens"] == offline.encode({"messages": MESSAGES})[1]
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello there"}


# -- errors -----------------------------------------------------------------------------------------------


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_a_missing_or_wrong_api_key_is_401(server):
    for key in (None, "sk-wrong"):
        response = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi"}, key=key)
        assert response.status_code == 401
        assert "API key" in error_of(response)["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_an_unknown_model_is_404(server):
    response = post(server, "/v1/completions", {"model": "gpt-17", "prompt": "hi"})
    assert response.status_code == 404 and error_of(response)["param"] == "model"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"frequency_penalty": 5}, "frequency_penalty"),
        ({"no_such_parameter": 1}, "no_such_parameter"),
        ({"min_p": 2.0}, "min_p"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"echo": True}, "echo"),
        ({"prompt": 123}, "prompt"),
        ({"n": 1000}, "n"),
    ],
)
def test_a_bad_field_is_400_naming_it(server, body, param):
    response = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", **body})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] is not None and error["param"].split(".")[0] == param, error
    assert param in error["message"]


def test_a_prompt_longer_than_the_context_is_400(server, offline):
    response = post(server, "/v1/completions", {"model": "tiny", "prompt": "word " * 600})
    assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"
    response = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1000})
    assert response.status_code == 400 and error_of(response)["param"] == "max_tokens"


def test_a_sampler_that_cannot_serve_a_parameter_is_400_naming_it(tiny_llama):
    with running_server(serve_settings(tiny_llama, "sampler.name=greedy")) as greedy_server:
        response = post(
            greedy_server, "/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 0, "top_k": 5}
        )
        assert response.status_code == 400
        error = error_of(response)
        assert "top_k" in error["message"] and error["param"] == "top_k"
        ok = post(greedy_server, "/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 0})
        assert ok.status_code == 200


# -- load, cancellation and limits ------------------------------------------------------------------------


async def open_stream(http: httpx.AsyncClient, url: str, max_tokens: int, n: int = 1, *, first_chunk: bool = True):
    """Start a streaming completion and read its first chunk; returns the open response and its line iterator.

    Keep both: a line iterator that is garbage-collected closes the response (a disconnect).
    """
    request = http.build_request(
        "POST",
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": "tiny",
            "prompt": "Count with me:",
            "max_tokens": max_tokens,
            "temperature": 0,
            "n": n,
            "stream": True,
            "ignore_eos": True,
        },
    )
    response = await http.send(request, stream=True)
    assert response.status_code == 200, await response.aread()
    lines = response.aiter_lines()
    while first_chunk and not (await anext(lines)).startswith("data: {"):
        pass
    return response, lines


def test_a_client_disconnect_mid_stream_frees_the_requests_blocks(server):
    async def scenario() -> dict[str, float]:
        async with httpx.AsyncClient(timeout=60) as http:
            response, _lines = await open_stream(http, server.url, max_tokens=400)
            busy = await asyncio.to_thread(server.metrics)
            await response.aclose()  # the client goes away mid-stream
            return busy

    busy = asyncio.run(scenario())
    assert busy["patchbay_kv_cache_blocks_in_use"] > 0 and busy["patchbay_num_requests_running"] == 1
    idle = server.wait_until_idle(timeout=10)
    assert idle['patchbay_request_success_total{finished_reason="abort"}'] >= 1
    assert idle["patchbay_generation_tokens_total"] < idle["patchbay_prompt_tokens_total"] + 400


def test_a_client_that_gives_up_on_a_non_streamed_request_aborts_it(server):
    before = server.metrics().get('patchbay_request_success_total{finished_reason="abort"}', 0.0)
    with pytest.raises(httpx.ReadTimeout):
        # 480 steps in 0.2 s would be 0.4 ms a step with HTTP around it: the client always gives up first.
        post_timeout = httpx.Timeout(60, read=0.2)
        httpx.post(
            f"{server.url}/v1/completions",
            timeout=post_timeout,
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={
                "model": "tiny",
                "prompt": "Count with me:",
                "max_tokens": 480,
                "n": 4,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
    idle = server.wait_until_idle(timeout=10)
    assert idle['patchbay_request_success_total{finished_reason="abort"}'] == before + 4


def test_closing_an_async_stream_frees_its_blocks_before_the_engines_next_step(server):
    llm = server.llm  # the server's own AsyncLLM, used from this test's event loop

    async def scenario() -> tuple[tuple, tuple, list]:
        _, token_ids = llm.encode("A prompt long enough to fill a few blocks of the KV cache. " * 4)
        stream = await llm.add_request(token_ids, SamplingParams(max_tokens=400, ignore_eos=True))
        async for delta in stream:
            assert delta.choices and not delta.finished
            break
        # Commands run in the engine thread between steps, in order: this one sees the request's blocks ...
        held = await llm.call(lambda engine: engine.kv_cache_manager.get_block_ids(stream.request_id))
        stream.close()
        # ... and this one, queued after the abort, sees them gone, whatever step ran in between.
        after = await llm.call(lambda engine: engine.kv_cache_manager.get_block_ids(stream.request_id))
        live = await llm.call(lambda engine: engine.live_outputs(stream.request_id))
        return held, after, live

    held, after, live = asyncio.run(scenario())
    assert sum(len(ids) for ids in held) >= 3
    assert all(not ids for ids in after)
    assert live == [] or [output.finish_reason for output in live] == ["abort"]  # retired by the next step
    server.wait_until_idle(timeout=10)


def test_an_aborted_request_ends_its_stream_with_finish_reason_abort(server):
    llm = server.llm

    async def scenario() -> list:
        stream = await llm.add_request([100, 200, 300], SamplingParams(max_tokens=400, ignore_eos=True, n=2))
        deltas = [await anext(stream)]
        await llm.abort(stream.request_id)
        deltas += [delta async for delta in stream]
        return deltas

    deltas = asyncio.run(scenario())
    last = deltas[-1]
    assert last.finished and [c.finish_reason for c in last.output.completions] == ["abort", "abort"]
    assert len(last.output.completions[0].token_ids) < 400
    server.wait_until_idle(timeout=10)


def test_shutdown_aborts_what_its_grace_period_leaves_and_refuses_new_requests(tiny_llama):
    async def scenario() -> list:
        llm = AsyncLLM(serve_settings(tiny_llama))
        stream = await llm.add_request([100, 200, 300], SamplingParams(max_tokens=480, ignore_eos=True))
        await anext(stream)
        await llm.shutdown(grace_period=0.2)
        rest = [delta async for delta in stream]
        with pytest.raises(EngineDeadError):
            await llm.add_request([100, 200, 300], SamplingParams())
        assert not llm.alive
        return rest

    rest = asyncio.run(scenario())
    assert rest[-1].finished and rest[-1].output.finish_reason == "abort"


def test_requests_over_the_admission_limit_get_503_and_the_rest_run(server):
    limit = MAX_NUM_SEQS + MAX_WAITING

    async def scenario() -> tuple[int, dict, list[int]]:
        async with httpx.AsyncClient(timeout=60) as http:
            # Admitted at once (the headers come before any token), so none can finish before the next is sent.
            streams = await asyncio.gather(
                *(open_stream(http, server.url, max_tokens=480, n=4, first_chunk=False) for _ in range(limit // 4))
            )
            refused = await http.post(
                f"{server.url}/v1/completions",
                headers={"Authorization": f"Bearer {API_KEY}"},
                json={"model": "tiny", "prompt": "one more", "max_tokens": 2},
            )
            for response, _lines in streams:
                await response.aclose()
            return refused.status_code, refused.json(), [refused.headers.get("retry-after")]

    status, body, retry_after = asyncio.run(scenario())
    assert status == 503 and body["error"]["code"] == "queue_full" and retry_after == ["1"]
    server.wait_until_idle(timeout=15)
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": "again", "max_tokens": 2}).status_code == 200


def test_a_bounded_load_of_concurrent_streams_completes_and_leaves_the_pool_empty(server, offline):
    num_clients, num_requests = 32, 256
    prompts = [f"Request number {i}: the answer is" for i in range(num_requests)]
    expected = {o.prompt: o.text for o in offline.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))}

    async def scenario() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        queue: asyncio.Queue = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        results = []

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                text = ""
                async for chunk in await client.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    text += chunk.choices[0].text
                results.append((prompt, text))

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(num_clients))), timeout=240)
        await client.close()
        return results

    results = asyncio.run(scenario())
    assert len(results) == num_requests
    assert {prompt: text for prompt, text in results} == expected
    idle = server.wait_until_idle(timeout=10)
    assert idle["patchbay_kv_cache_usage_ratio"] == 0.0
    assert idle["patchbay_time_to_first_token_seconds_count"] >= num_requests
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_expose_counters_histograms_and_step_phases(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "patchbay_num_requests_running",
        "patchbay_num_requests_waiting",
        "patchbay_kv_cache_usage_ratio",
        "patchbay_prefix_cache_hits_total",
        "patchbay_prefix_cache_queries_total",
        "patchbay_prompt_tokens_total",
        "patchbay_generation_tokens_total",
        "patchbay_time_to_first_token_seconds_bucket",
        "patchbay_inter_token_latency_seconds_bucket",
        "patchbay_e2e_request_latency_seconds_bucket",
        "patchbay_spec_decode_num_draft_tokens_total",
        "patchbay_kv_connector_loaded_tokens_total",
        'phase="forward",plugin="attention"',
    ):
        assert name in text, name
