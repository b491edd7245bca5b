"""No input exhausts the machine: YAML alias bombs, deep nesting and memory settings beyond the machine are
refused with an error naming the source and key (issue 14)."""

from __future__ import annotations

import pytest

import patchbay
from patchbay.contract import bounded_yaml
from patchbay.contract.settings import ConfigError, load_settings

# 9 levels of 9 aliases: about 1 KB of YAML, 9**9 (387 million) values once expanded.
BOMB = "\n".join(
    [f"  l0: &l0 [{', '.join(['lol'] * 9)}]"]
    + [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
)


@pytest.mark.parametrize("where", ["junk:\n", "sampler:\n  name: standard\n  options:\n    junk:\n"])
def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded(tmp_path, where):
    indented = BOMB if where == "junk:\n" else "\n".join("    " + line for line in BOMB.splitlines())
    path = tmp_path / "bomb.yaml"
    path.write_text(where + indented + "\n")
    assert path.stat().st_size < 1500
    with pytest.raises(ConfigError, match=r"bomb.yaml: <file>: document expands to more than 1000000 values"):
        load_settings(path)


def test_a_bomb_in_a_set_flag_is_refused_naming_the_flag():
    value = (
        "{a: &a [1,1,1,1,1,1,1,1,1,1], b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], "
        "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], "
        "e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], f: [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]}"
    )
    with pytest.raises(ConfigError, match=r"--set sampler.options=.*: sampler.options: document expands"):
        load_settings(overrides=[f"sampler.options={value}"])


def test_a_deeply_nested_env_value_is_refused(monkeypatch):
    monkeypatch.setenv("PATCHBAY_SAMPLER__OPTIONS", '{"a": ' * 200 + "1" + "}" * 200)
    with pytest.raises(ConfigError, match="env PATCHBAY_SAMPLER__OPTIONS: <env>: document nested more than 64"):
        load_settings()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: &a [*a]\n", "contains itself"),
        ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested"),
    ],
)
def test_recursive_and_deep_yaml_are_refused(tmp_path, text, message):
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(path)


def test_a_document_over_the_size_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(bounded_yaml, "MAX_BYTES", 1000)
    path = tmp_path / "big.yaml"
    path.write_text("inputs:\n  prompts:\n" + "    - hello world\n" * 100)
    with pytest.raises(ConfigError, match="document of 1819 bytes exceeds the limit of 1000 bytes"):
        load_settings(path)


def test_shared_anchors_within_the_bounds_still_load(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("inputs:\n  sampling: &s {max_tokens: 4}\n  prompts:\n    - {prompt: a, <<: *s}\n")
    assert load_settings(path).inputs.prompts == [{"prompt": "a", "max_tokens": 4}]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"cache__memory": "1PB"},
            r"cache.memory: the KV cache \(\d+ blocks of .*\) needs 909.5 TiB; cpu memory available",
        ),
        (
            {"cache__num_blocks": 10**8},
            r"cache.num_blocks: the KV cache \(100000000 blocks of .*\) needs .* GiB; cpu memory",
        ),
    ],
)
def test_memory_settings_beyond_the_machine_are_refused_with_the_figures(tiny_llama, overrides, message):
    with pytest.raises(ConfigError, match=message):
        patchbay.LLM(model__path=str(tiny_llama), attention__name="torch_sdpa", **overrides)


def test_buffers_are_sized_by_what_the_pool_can_hold_not_by_the_raw_limits(tiny_llama):
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        cache__num_blocks=33,
        cache__block_size=16,
        scheduler__max_num_seqs=10**9,
        scheduler__max_num_batched_tokens=10**9,
        model__max_model_len=256,
    )
    runner = llm.engine.runner
    assert runner.batch.max_num_reqs == 32  # one block per running request at least
    assert runner.batch.token_ids.nbytes == 32 * 257 * 4
    assert len(runner._arange) == 32 * 16 + 1  # one token per KV slot at most
    assert len(llm.generate([[1, 2, 3]] * 3, patchbay.SamplingParams(max_tokens=3))) == 3


def test_n_is_bounded_offline_before_any_sequence_is_built(tiny_llama, tmp_path, capsys):
    """Issue 30: ``n`` was unbounded offline; ``LLM.generate`` or a JSONL line with ``n=10**7`` built ten million
    sequences up front.  Both refuse it with an error naming the request and ``scheduler.max_n``."""
    from patchbay.entrypoints.cli import main

    llm = patchbay.LLM(model__path=str(tiny_llama), attention__name="torch_sdpa", cache__num_blocks=64)
    for n in (10**7, 1025):
        with pytest.raises(ValueError, match=rf"request 1: n={n} sequences exceeds scheduler.max_n=1024"):
            llm.generate(
                ["hi", "there"], [patchbay.SamplingParams(max_tokens=2), patchbay.SamplingParams(max_tokens=2, n=n)]
            )
        assert not llm.engine.has_unfinished_requests()
    outputs = llm.generate("hi", patchbay.SamplingParams(max_tokens=2, n=3))
    assert len(outputs[0].completions) == 3  # the engine is untouched and n within the bound runs

    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "a", "max_tokens": 2}\n{"prompt": "b", "max_tokens": 2, "n": 5}\n')
    config = tmp_path / "job.yaml"
    config.write_text(
        f"model: {{path: '{tiny_llama}'}}\nscheduler: {{max_n: 4}}\n"
        f"inputs: {{chat_template: false, file: '{requests}'}}\noutputs: {{path: '{tmp_path / 'out'}'}}\n"
    )
    assert main(["run", str(config)]) == 2
    error = capsys.readouterr().err
    assert f"{requests}:2" in error and "n=5 sequences exceeds scheduler.max_n=4" in error
    assert not (tmp_path / "out").exists()
