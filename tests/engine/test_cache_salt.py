"""``cache_salt`` keeps tenants' prefix caches apart (issue 30).

Finding: tenants sharing a server shared the prefix cache, so one could time
another's prompts; the salt in the block hashes was LoRA's alone and nothing
let a user set one.  The salt enters the first block's hash, so the same
prompt with two salts never hits, the same salt hits, and the KV connector's
keys (built from the hashes) differ too.
"""

from __future__ import annotations

import pytest

import patchbay
from patchbay.contract.settings import Settings
from patchbay.entrypoints.run_command import read_requests
from patchbay.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest, sampling_params
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.request import Request

PROMPT = list(range(100, 124))  # 6 full blocks of 4


@pytest.fixture(scope="module")
def llm(tiny_llama) -> patchbay.LLM:
    return patchbay.LLM(
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        runtime__threads=2,
        model__max_model_len=64,
        cache__num_blocks=64,
        cache__block_size=4,
    )


def _cached(llm: patchbay.LLM, salt: str | None) -> int:
    (output,) = llm.generate([PROMPT], SamplingParams(max_tokens=1, cache_salt=salt))
    return output.metrics.num_cached_tokens


def test_the_same_prompt_with_another_salt_never_hits_and_the_same_salt_does(llm):
    assert _cached(llm, "tenant-a") == 0
    assert _cached(llm, "tenant-b") == 0, "another tenant's salt must not reuse tenant-a's blocks"
    assert _cached(llm, None) == 0, "no salt must not reuse a salted tenant's blocks"
    assert _cached(llm, "tenant-a") == 20, "the same salt reuses every full block but the last token's"
    assert _cached(llm, "tenant-b") == 20
    assert _cached(llm, None) == 20


def test_a_salt_combines_with_the_lora_salt_and_changes_every_block_hash():
    plain = Request("a", PROMPT, SamplingParams(), block_size=4)
    salted = Request("b", PROMPT, SamplingParams(cache_salt="t"), block_size=4, cache_salt=b"t")
    adapter = Request("c", PROMPT, SamplingParams(lora="x", cache_salt="t"), block_size=4, cache_salt=b"t")
    assert not set(plain.block_hashes) & set(salted.block_hashes)
    assert not set(salted.block_hashes) & set(adapter.block_hashes), "the adapter still separates its blocks"


def test_cache_salt_is_no_sampler_parameter_and_must_not_be_empty():
    assert "cache_salt" not in SamplingParams(cache_salt="t").params_used()
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_jsonl_lines_and_server_bodies_carry_a_salt(tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "a", "cache_salt": "tenant-a"}\n{"prompt": "b"}\n')
    settings = Settings.model_validate({"inputs": {"file": str(requests)}})
    (_, _, first), (_, _, second) = read_requests(settings, None)
    assert (first.cache_salt, second.cache_salt) == ("tenant-a", None)
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "cache_salt": "tenant-b"}
    )
    assert sampling_params(chat.sampling_fields(), max_tokens=4, default_max_tokens=4).cache_salt == "tenant-b"
    completion = CompletionRequest.model_validate({"prompt": "hi", "cache_salt": "tenant-c"})
    assert sampling_params(completion.sampling_fields(), max_tokens=4, default_max_tokens=4).cache_salt == "tenant-c"
