"""DeepSeek's MLA beyond the kit: the latent cache's size against the config's arithmetic, and the fast backend.

The kit (test_architecture_plugins.py) proves the tokens against transformers with the reference backend; here
the cache is shown to hold one latent row per token (and the pool to be sized by it), and ``torch_sdpa``'s latent
path (the C++ kernel for short queries, SDPA over gathered rows for long ones) to give the reference's tokens.
"""

from __future__ import annotations

import random

import pytest

import patchbay
from patchbay.contract.settings import ConfigError
from patchbay.sampling_params import SamplingParams
from patchbay.testing.tiny_models import tiny_checkpoint

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@pytest.fixture(scope="module", params=ARCHITECTURES)
def deepseek(request: pytest.FixtureRequest):
    return tiny_checkpoint(request.param)


def _llm(model_dir, **settings):
    return patchbay.LLM(
        model__path=str(model_dir), runtime__threads=1, model__dtype="float32", model__max_model_len=512, **settings
    )


def test_the_cache_holds_one_latent_row_per_token(deepseek):
    llm = _llm(deepseek, attention__name="reference", cache__memory=4 << 20)
    config = llm.engine.model.model.config
    (group,) = llm.engine.groups
    row = config.kv_lora_rank + config.qk_rope_head_dim
    assert (group.spec.latent, group.spec.num_kv_heads, group.spec.head_size) == (True, 1, row)
    assert len(group.layer_names) == config.num_hidden_layers
    # float32: 4 bytes a feature, one row per token and layer, no key/value pair.
    per_token = config.num_hidden_layers * row * 4
    assert llm.engine.report().kv_bytes_per_token == per_token
    expanded = (
        config.num_hidden_layers
        * config.num_attention_heads
        * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
        * 4
    )
    assert per_token * 3 < expanded  # what caching the expanded keys and values would take
    # The pool is sized by it: 4 MiB over blocks of 16 tokens.
    assert llm.engine.num_blocks == (4 << 20) // (16 * per_token)
    (cache,) = {llm.engine.runner.kv_caches[name].shape for name in group.layer_names}
    assert cache == (llm.engine.num_blocks, 16, 1, row)


def test_torch_sdpa_gives_the_reference_backends_tokens(deepseek):
    rng = random.Random(5)
    # Short prompts go to the C++ kernel, the 300-token one to SDPA over its gathered rows.
    prompts = [[rng.randrange(100, 40_000) for _ in range(n)] for n in (3, 40, 300, 17)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    expected = [o.token_ids for o in _llm(deepseek, attention__name="reference").generate(prompts, params)]
    fast = _llm(deepseek, attention__name="torch_sdpa", attention__options={"decode_kernel": "paged_cpp"})
    assert [o.token_ids for o in fast.generate(prompts, params)] == expected
    assert fast.engine.backend_name == "torch_sdpa"


def test_a_backend_without_latent_rows_is_refused_naming_the_reason(deepseek):
    with pytest.raises(ConfigError, match="MLA's latent KV cache"):
        _llm(deepseek, attention__name="flex")


def test_a_kv_connector_is_refused_naming_the_latent_rows(deepseek, tmp_path):
    with pytest.raises(ConfigError, match="kv_connector.*MLA latent rows"):
        _llm(
            deepseek,
            attention__name="reference",
            kv_connector={"name": "shared_storage", "options": {"path": str(tmp_path)}},
        )
