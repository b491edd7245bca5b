"""Runtime LoRA updates on a real server: load, serve, refuse bad adapters, unload (409 while in use)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from lora_adapters import ADAPTER_SPECS, make_peft_adapter, peft_greedy

from patchbay.contract.settings import Settings

KEY = "sk-test-lora"


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(tiny_llama, folder / name, seed=index, **spec)
        for index, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }


def _settings(tiny_llama: Path, lora: dict | None) -> Settings:
    return Settings(
        model={"path": str(tiny_llama), "dtype": "float32"},
        runtime={"threads": 2},
        cache={"num_blocks": 256},
        server={"served_model_name": "tiny", "api_keys": [KEY]},
        lora=lora,
    )


def _post(url: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


def _error(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


@pytest.mark.slow
def test_an_adapter_loaded_at_runtime_serves_peft_s_tokens_and_unloads(tiny_llama, adapters):
    import openai
    from serving import running_server

    prompt = [5, 17, 301, 44, 1200, 9, 77]
    settings = _settings(
        tiny_llama,
        {"adapters": {"attn-r4": str(adapters["attn-r4"])}, "max_lora_rank": 4, "allow_runtime_updates": True},
    )
    with running_server(settings) as server:
        url = server.url
        body = {"lora_name": "mlp", "lora_path": str(adapters["mlp-r8"])}
        assert _post(url, "/v1/load_lora_adapter", body, key=None).status_code == 401
        too_large = _post(url, "/v1/load_lora_adapter", body)
        assert too_large.status_code == 400
        assert _error(too_large) == "LoRA adapter 'mlp': rank 8 exceeds lora.max_lora_rank (4)"
        missing = _post(url, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(adapters["mlp-r8"]) + "x"})
        assert missing.status_code == 400 and "'gone'" in _error(missing)
        assert missing.json()["error"]["param"] == "lora_path"
        mixed_path = str(adapters["all-r2-rslora"])
        base_name = _post(url, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": mixed_path})
        assert base_name.status_code == 400 and "base model" in _error(base_name)

        loaded = _post(url, "/v1/load_lora_adapter", {"lora_name": "mixed", "lora_path": mixed_path})
        assert loaded.status_code == 200, loaded.text
        again = _post(url, "/v1/load_lora_adapter", {"lora_name": "mixed", "lora_path": str(adapters["attn-r4"])})
        assert again.status_code == 400 and "'mixed' is already loaded" in _error(again)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        assert {model.id for model in client.models.list().data} == {"tiny", "attn-r4", "mixed"}
        want = {
            name: peft_greedy(tiny_llama, path, [prompt], 8)[0]
            for name, path in [("mixed", adapters["all-r2-rslora"]), ("tiny", None)]
        }
        assert want["mixed"] != want["tiny"], "the adapter must change the greedy tokens, or this test proves little"
        for name in ("mixed", "tiny"):
            served = client.completions.create(
                model=name, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert served.model == name
            text = httpx.post(
                f"{url}/detokenize", json={"tokens": want[name]}, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
            ).json()["prompt"]
            assert served.choices[0].text == text, name

        # An adapter that a request in flight uses cannot be unloaded: 409 naming it.  The engine thread is held
        # between steps while the completion and then the unload queue up, so the unload finds it unfinished.
        answers = _with_engine_held(
            server,
            [
                lambda: _post(url, "/v1/completions", {"model": "mixed", "prompt": prompt, "max_tokens": 4}),
                lambda: _post(url, "/v1/unload_lora_adapter", {"lora_name": "mixed"}),
            ],
        )
        completed, busy = answers
        assert completed.status_code == 200 and completed.json()["model"] == "mixed"
        assert busy.status_code == 409
        assert _error(busy).startswith("LoRA adapter 'mixed' is used by 1 unfinished request(s)")
        server.wait_until_idle()

        unknown = _post(url, "/v1/unload_lora_adapter", {"lora_name": "nope"})
        assert unknown.status_code == 404 and "LoRA adapter 'nope' is not loaded" in _error(unknown)
        assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "mixed"}).status_code == 200
        gone = _post(url, "/v1/completions", {"model": "mixed", "prompt": "a", "max_tokens": 2})
        assert gone.status_code == 404 and "'mixed' does not exist" in _error(gone)
        assert {model.id for model in client.models.list().data} == {"tiny", "attn-r4"}
        # The listed adapter still serves after the other came and went.
        assert client.completions.create(model="attn-r4", prompt=prompt, max_tokens=2).model == "attn-r4"


def _with_engine_held(server, calls):
    """Run each HTTP call in its own thread while the engine thread is held, releasing it once all their engine
    commands are queued (so they run in this order, together, before the next step); their responses."""
    import asyncio
    import threading

    llm = server.llm
    held, release = threading.Event(), threading.Event()

    def hold(_: object) -> None:
        held.set()
        release.wait(60)

    holding = threading.Thread(target=lambda: asyncio.run(llm.call(hold)))
    holding.start()
    _wait_for(held.is_set)  # the engine thread is blocked between steps; commands now queue up
    answers: list = [None] * len(calls)
    threads = []
    for index, call in enumerate(calls):
        thread = threading.Thread(target=lambda i=index, c=call: answers.__setitem__(i, c()))
        thread.start()
        threads.append(thread)
        _wait_for(lambda n=index + 1: len(llm._commands) == n)
    release.set()
    for thread in [holding, *threads]:
        thread.join(120)
    return answers


def _wait_for(condition) -> None:
    import time

    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, {}], ids=["no-lora-section", "updates-off"])
def test_runtime_updates_are_off_unless_enabled(tiny_llama, adapters, lora):
    from serving import running_server

    with running_server(_settings(tiny_llama, lora)) as server:
        answer = _post(server.url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["attn-r4"])})
        assert answer.status_code == 404
        assert "allow_runtime_updates" in _error(answer)
        assert _post(server.url, "/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 404


def test_the_engine_refuses_to_unload_an_adapter_that_unfinished_requests_use(tiny_llama, adapters):
    import patchbay
    from patchbay import SamplingParams
    from patchbay.worker.lora.catalog import AdapterInUseError, UnknownAdapterError

    llm = patchbay.LLM(_settings(tiny_llama, {"max_lora_rank": 8}))
    engine = llm.engine
    engine.load_lora_adapter("mlp", str(adapters["mlp-r8"]))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True, lora="mlp"), request_id="r1")
    engine.step()
    with pytest.raises(AdapterInUseError, match=r"LoRA adapter 'mlp' is used by 1 unfinished request\(s\) \(r1\)"):
        engine.unload_lora_adapter("mlp")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_lora_adapter("mlp")
    with pytest.raises(UnknownAdapterError, match="LoRA adapter 'mlp' is not loaded"):
        engine.unload_lora_adapter("mlp")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'mlp'"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, lora="mlp"))
