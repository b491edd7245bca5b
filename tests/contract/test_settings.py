"""Run settings: YAML, defaults, env and --set overrides, plugin options, and errors that say where."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from patchbay import hookimpl
from patchbay.contract.registry import Registry, default_registry
from patchbay.contract.settings import ConfigError, Settings, dump_settings, load_settings, plugin_options
from patchbay.interfaces import AttentionBackend, AttentionMetadataBuilder, Sampler, SamplerOutput


@pytest.fixture(autouse=True)
def no_patchbay_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without PATCHBAY_* variables."""
    for key in [key for key in os.environ if key.startswith("PATCHBAY_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def write_yaml(tmp_path: Path):
    def write(text: str, name: str = "run.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


def problems_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> list[tuple[str, str, str]]:
    return [(problem.source, problem.path, problem.message) for problem in excinfo.value.problems]


# -- loading ---------------------------------------------------------------------------------------


def test_defaults_need_no_file():
    settings = load_settings()
    assert settings == Settings()
    assert settings.model.path == "default"
    assert settings.attention.name == "auto"
    assert settings.sampler.name == "standard"
    assert settings.cache.block_size == 16
    assert settings.spec_decode is None and settings.kv_connector is None


def test_yaml_sets_what_it_names_and_leaves_the_rest_at_defaults(write_yaml):
    path = write_yaml("""
        model: {path: /models/smol, dtype: bfloat16}
        cache: {block_size: 32, memory: 512MiB}
        scheduler: {max_num_seqs: 8}
        spec_decode: {name: ngram, num_speculative_tokens: 4, options: {prompt_lookup_max: 3}}
        kv_connector: {name: shared_storage, role: producer}
    """)
    settings = load_settings(path)
    assert settings.model.path == "/models/smol" and settings.model.dtype == "bfloat16"
    assert settings.cache.block_size == 32 and settings.cache.memory == 512 * 2**20
    assert settings.scheduler.max_num_seqs == 8
    assert settings.scheduler.max_num_batched_tokens == 2048  # default
    assert settings.spec_decode.name == "ngram" and settings.spec_decode.options == {"prompt_lookup_max": 3}
    assert settings.kv_connector.role == "producer"


def test_an_empty_yaml_file_means_defaults(write_yaml):
    assert load_settings(write_yaml("")) == Settings()


@pytest.mark.parametrize(
    ("text", "message"),
    [("- a\n- b\n", "expected a mapping at top level, got list"), ("model: [unclosed\n", "not valid YAML")],
)
def test_a_file_that_is_not_a_settings_mapping_is_an_error_naming_it(write_yaml, text, message):
    path = write_yaml(text)
    with pytest.raises(ConfigError) as excinfo:
        load_settings(path)
    ((source, key, found),) = problems_of(excinfo)
    assert (source, key) == (str(path), "<file>")
    assert message in found


def test_a_missing_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="no-such.yaml: <file>: cannot read"):
        load_settings(tmp_path / "no-such.yaml")


# -- unknown keys and wrong types ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key_path"),
    [
        ("modle: {path: x}\n", "modle"),
        ("cache: {blok_size: 8}\n", "cache.blok_size"),
        ("spec_decode: {name: ngram, optoins: {}}\n", "spec_decode.optoins"),
        ("plugins: {deny: [a], stict: true}\n", "plugins.stict"),
    ],
)
def test_unknown_keys_at_any_depth_are_errors_naming_file_and_key_path(write_yaml, text, key_path):
    path = write_yaml(text)
    with pytest.raises(ConfigError) as excinfo:
        load_settings(path)
    assert problems_of(excinfo) == [(str(path), key_path, "unknown key")]
    assert f"{path}: {key_path}: unknown key" in str(excinfo.value)


@pytest.mark.parametrize(
    ("text", "key_path", "message"),
    [
        ("scheduler: {max_num_seqs: many}\n", "scheduler.max_num_seqs", "valid integer"),
        ("cache: {block_size: 0}\n", "cache.block_size", "greater than 0"),
        ("model: {dtype: float8}\n", "model.dtype", "'auto', 'float32', 'bfloat16' or 'float16'"),
        ("cache: {memory: lots}\n", "cache.memory", "could not parse value and unit from byte string"),
        ("spec_decode: {num_speculative_tokens: 2}\n", "spec_decode.name", "required key is missing"),
    ],
)
def test_wrong_types_are_errors_naming_file_key_path_and_value(write_yaml, text, key_path, message):
    path = write_yaml(text)
    with pytest.raises(ConfigError) as excinfo:
        load_settings(path)
    ((source, found_path, found_message),) = problems_of(excinfo)
    assert (source, found_path) == (str(path), key_path)
    assert message in found_message


def test_every_problem_is_reported_at_once(write_yaml):
    path = write_yaml("cache: {blok_size: 8}\nscheduler: {max_num_seqs: many}\n")
    with pytest.raises(ConfigError) as excinfo:
        load_settings(path)
    assert {key for _, key, _ in problems_of(excinfo)} == {"cache.blok_size", "scheduler.max_num_seqs"}


def test_num_blocks_and_memory_together_are_an_error(write_yaml):
    path = write_yaml("cache: {num_blocks: 512, memory: 1GiB}\n")
    with pytest.raises(ConfigError) as excinfo:
        load_settings(path)
    ((source, key, message),) = problems_of(excinfo)
    assert (source, key) == (str(path), "cache")
    assert "either num_blocks or memory, not both" in message


# -- overrides: env beats YAML, --set beats env -----------------------------------------------------


def test_env_overrides_yaml_and_set_overrides_env(write_yaml, monkeypatch):
    path = write_yaml("scheduler: {max_num_seqs: 4, max_num_batched_tokens: 512}\n")
    assert load_settings(path).scheduler.max_num_seqs == 4

    monkeypatch.setenv("PATCHBAY_SCHEDULER__MAX_NUM_SEQS", "8")
    settings = load_settings(path)
    assert settings.scheduler.max_num_seqs == 8
    assert settings.scheduler.max_num_batched_tokens == 512  # the rest of the YAML section stays

    settings = load_settings(path, overrides=["scheduler.max_num_seqs=16"])
    assert settings.scheduler.max_num_seqs == 16


def test_set_values_are_yaml_scalars(write_yaml):
    settings = load_settings(
        overrides=[
            "cache.prefix_caching=false",
            "sampler.options={top_k: 5}",
            "inputs.prompts=[hi, there]",
            "cache.memory=2GiB",
        ]
    )
    assert settings.cache.prefix_caching is False
    assert settings.sampler.options == {"top_k": 5}
    assert settings.inputs.prompts == ["hi", "there"]
    assert settings.cache.memory == 2 * 2**30


def test_a_malformed_set_is_an_error():
    with pytest.raises(ConfigError, match="--set scheduler.max_num_seqs: .*expected KEY.PATH=VALUE"):
        load_settings(overrides=["scheduler.max_num_seqs"])


def test_errors_name_the_env_var_that_set_the_value(write_yaml, monkeypatch):
    monkeypatch.setenv("PATCHBAY_SCHEDULER__MAX_NUM_SEQS", "lots")
    with pytest.raises(ConfigError) as excinfo:
        load_settings(write_yaml("scheduler: {max_num_seqs: 4}\n"))
    ((source, key, message),) = problems_of(excinfo)
    assert source == "env PATCHBAY_SCHEDULER__MAX_NUM_SEQS"
    assert key == "scheduler.max_num_seqs"
    assert "(got 'lots')" in message


def test_errors_name_the_set_flag_that_set_the_value(write_yaml):
    with pytest.raises(ConfigError) as excinfo:
        load_settings(write_yaml("cache: {block_size: 16}\n"), overrides=["cache.block_size=-1"])
    ((source, key, _),) = problems_of(excinfo)
    assert (source, key) == ("--set cache.block_size=-1", "cache.block_size")


def test_an_unknown_key_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("PATCHBAY_SCHEDULER__MAX_SEQS", "8")
    with pytest.raises(ConfigError) as excinfo:
        load_settings()
    assert problems_of(excinfo) == [("env PATCHBAY_SCHEDULER__MAX_SEQS", "scheduler.max_seqs", "unknown key")]


def test_patchbay_variables_that_are_not_settings_are_left_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path))  # the model loader's cache, not `cache:` settings
    assert load_settings().cache == Settings().cache


def test_a_malformed_json_value_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("PATCHBAY_INPUTS__PROMPTS", "[unclosed")
    with pytest.raises(ConfigError, match="env PATCHBAY_INPUTS__PROMPTS"):
        load_settings()


def test_the_plugin_deny_list_takes_comma_separated_names_from_the_environment(monkeypatch):
    monkeypatch.setenv("PATCHBAY_PLUGINS__DENY", "patchbay-broken-plugin, sampler:greedy,,")
    monkeypatch.setenv("PATCHBAY_PLUGINS__STRICT", "true")
    policy = load_settings().plugins
    assert policy.deny == ["patchbay-broken-plugin", "sampler:greedy"]
    assert policy.strict is True


def test_the_default_registry_applies_the_deny_list_from_the_environment(monkeypatch):
    assert "greedy" in default_registry(strict=False).names("sampler")
    monkeypatch.setenv("PATCHBAY_PLUGINS__DENY", "sampler:greedy")
    assert "greedy" not in default_registry(strict=False).names("sampler")


# -- plugin sections ---------------------------------------------------------------------------------


class TunableBackend(AttentionBackend):
    """An attention backend with options (never run here)."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        scale_override: float | None = None
        chunk: int = Field(default=256, gt=0)

    def make_impl(self, layer):
        raise NotImplementedError


class PlainSampler(Sampler):
    """A sampler without options: any key in its section is an error."""

    def sample(self, logits, metadata):
        return SamplerOutput(sampled_token_ids=logits.argmax(-1, keepdim=True))


class PassThroughBuilder(AttentionMetadataBuilder):
    """The metadata builder TunableBackend names (a run-time choice must name an installed builder)."""

    def build(self, common):
        return common


class SettingsTestPlugins:
    @hookimpl
    def register_attention_backends(self, register):
        register("tunable", TunableBackend)

    @hookimpl
    def register_attention_metadata_builders(self, register):
        register(TunableBackend.metadata_builder, PassThroughBuilder)

    @hookimpl
    def register_samplers(self, register):
        register("plain", PlainSampler)
        register("plain_too", PlainSampler)


def test_a_sampler_named_for_the_wrong_role_is_an_error(write_yaml, registry):
    path = write_yaml("sampler: {name: plain}\nspec_decode: {name: ngram, rejection_sampler: plain_too}\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, registry=registry)
    messages = [str(problem) for problem in caught.value.problems]
    assert any("spec_decode.rejection_sampler.name" in m and "needs a 'verify' one" in m for m in messages), messages
    assert not any(m.startswith(f"{path}: sampler.name") for m in messages)


@pytest.fixture
def registry() -> Registry:
    registry = Registry()
    registry.add_plugin(SettingsTestPlugins(), name="settings-test")
    return registry


def test_plugin_options_are_validated_against_the_plugins_model(write_yaml, registry):
    path = write_yaml("attention: {name: tunable, options: {scale_override: 0.5, chunk: 64}}\nsampler: {name: plain}\n")
    settings = load_settings(path, registry=registry)
    assert settings.attention.options == {"scale_override": 0.5, "chunk": 64}


@pytest.mark.parametrize(
    ("options", "key_path", "message"),
    [
        ("{x: 1}", "attention.options.x", "unknown key"),
        ("{scale_override: big}", "attention.options.scale_override", "valid number"),
        ("{chunk: 0}", "attention.options.chunk", "greater than 0"),
    ],
)
def test_bad_plugin_options_name_the_file_key_path_and_plugin(write_yaml, registry, options, key_path, message):
    path = write_yaml(f"attention: {{name: tunable, options: {options}}}\nsampler: {{name: plain}}\n")
    with pytest.raises(ConfigError) as excinfo:
        load_settings(path, registry=registry)
    (problem,) = excinfo.value.problems
    assert (problem.source, problem.path, problem.plugin) == (str(path), key_path, "attention:tunable")
    assert message in problem.message
    assert f"{path}: {key_path} (plugin attention:tunable): " in str(excinfo.value)


def test_bad_plugin_options_from_set_name_the_flag(registry):
    with pytest.raises(ConfigError) as excinfo:
        load_settings(overrides=["sampler.name=plain", "sampler.options.temperature=0.7"], registry=registry)
    (problem,) = excinfo.value.problems
    assert problem.source == "--set sampler.options.temperature=0.7"
    assert (problem.path, problem.plugin, problem.message) == (
        "sampler.options.temperature",
        "sampler:plain",
        "unknown key",
    )


def test_unknown_plugin_names_list_the_available_choices(write_yaml, registry):
    path = write_yaml("attention: {name: tunabel}\nsampler: {name: greedy}\n")
    with pytest.raises(ConfigError) as excinfo:
        load_settings(path, registry=registry)
    problems = {problem.path: problem for problem in excinfo.value.problems}
    assert set(problems) == {"attention.name", "sampler.name"}
    assert problems["attention.name"].source == str(path)
    assert "no attention backend named 'tunabel' is installed; available: tunable" in problems["attention.name"].message
    assert "available: plain, plain_too" in problems["sampler.name"].message


def test_options_with_backend_auto_are_an_error(write_yaml, registry):
    path = write_yaml("attention: {options: {chunk: 64}}\nsampler: {name: plain}\n")
    with pytest.raises(ConfigError, match="attention.options: options need a named backend"):
        load_settings(path, registry=registry)


def test_without_a_registry_plugin_names_and_options_are_not_checked(write_yaml):
    settings = load_settings(write_yaml("sampler: {name: not_installed, options: {anything: 1}}\n"))
    assert settings.sampler.name == "not_installed"


def test_plugin_options_helper_validates_and_names_the_key_path():
    assert plugin_options(TunableBackend, {"chunk": 8}, where="attention.options").chunk == 8
    with pytest.raises(ConfigError, match=r"attention\.options\.chunk: .*greater than 0"):
        plugin_options(TunableBackend, {"chunk": -1}, where="attention.options")


# -- dump ----------------------------------------------------------------------------------------------


def test_dump_then_load_gives_the_same_settings(write_yaml, tmp_path):
    original = load_settings(
        write_yaml("""
model: {path: /models/smol, max_model_len: 1024}
cache: {memory: 512MiB, prefix_caching: false}
attention: {name: torch_sdpa, options: {scale_override: 0.125}}
spec_decode: {name: ngram, num_speculative_tokens: 2, options: {n: 3}}
kv_connector: {name: shared_storage, options: {path: /tmp/kv}}
plugins: {deny: [patchbay-broken-plugin]}
inputs: {prompts: [hello, {prompt: hi, max_tokens: 4}], sampling: {max_tokens: 8}}
outputs: {path: results.jsonl}
"""),
        overrides=["scheduler.max_num_seqs=3"],
    )

    dumped = tmp_path / "effective.yaml"
    dumped.write_text(dump_settings(original))
    assert load_settings(dumped) == original
    assert dump_settings(load_settings(dumped)) == dump_settings(original)


def test_the_dump_shows_every_key_with_overrides_applied(monkeypatch):
    monkeypatch.setenv("PATCHBAY_SCHEDULER__MAX_NUM_SEQS", "8")
    text = dump_settings(load_settings())
    assert "max_num_seqs: 8" in text
    assert "block_size: 16" in text  # defaults are shown, not only what was set


def test_a_backend_whose_metadata_builder_is_not_installed_is_a_validation_error(write_yaml):
    class OnlyTheBackend:
        @hookimpl
        def register_attention_backends(self, register):
            register("tunable", TunableBackend)

    registry = Registry()
    registry.add_plugin(OnlyTheBackend(), name="backend-only")
    path = write_yaml("attention: {name: tunable}\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, registry=registry)
    (problem,) = [problem for problem in caught.value.problems if problem.path.startswith("attention")]
    assert (problem.source, problem.path, problem.plugin) == (str(path), "attention.name", "attention:tunable")
    assert problem.message.startswith(
        "attention:tunable's metadata builder 'common' cannot be used: no attention-metadata builder named 'common'"
    )


def test_set_null_clears_a_value_or_a_mapping_and_so_does_the_environment(write_yaml, registry, monkeypatch):
    path = write_yaml(
        "attention: {name: tunable, options: {chunk: 64}}\nmodel: {max_model_len: 256}\nsampler: {name: plain}\n"
    )
    # 'auto' with the YAML's options is an error that names where 'auto' came from and how to clear the options.
    with pytest.raises(ConfigError) as caught:
        load_settings(path, overrides=["attention.name=auto"], registry=registry)
    (problem,) = caught.value.problems
    assert "attention.name is 'auto' (from --set attention.name=auto)" in problem.message
    assert "--set attention.options=null" in problem.message

    cleared = load_settings(
        path,
        overrides=["attention.name=auto", "attention.options=null", "model.max_model_len=null"],
        registry=registry,
    )
    assert (cleared.attention.name, cleared.attention.options, cleared.model.max_model_len) == ("auto", {}, None)

    monkeypatch.setenv("PATCHBAY_ATTENTION__OPTIONS", "null")
    monkeypatch.setenv("PATCHBAY_ATTENTION__NAME", "auto")
    from_env = load_settings(path, registry=registry)
    assert (from_env.attention.name, from_env.attention.options) == ("auto", {})


# -- one key chooses every plugin: `name` and `options`; the keys it replaced still read until 0.2 ---------


@pytest.mark.parametrize(
    "old, new",
    [
        ({"attention": {"backend": "reference"}}, {"attention": {"name": "reference"}}),
        ({"speculative": {"method": "ngram"}}, {"spec_decode": {"name": "ngram"}}),
        ({"structured_output": {"backend": "llguidance"}}, {"structured_output": {"name": "llguidance"}}),
        (
            {"lora": {"kernel": "torch", "kernel_options": {"a": 1}}},
            {"lora": {"kernel": {"name": "torch", "options": {"a": 1}}}},
        ),
        ({"lora": {"kernel_options": {"a": 1}}}, {"lora": {"kernel": {"name": "torch", "options": {"a": 1}}}}),
        (
            {"lora": {"resolver": "directory", "resolver_options": {"root": "/x"}}},
            {"lora": {"resolver": {"name": "directory", "options": {"root": "/x"}}}},
        ),
        (
            {"chat": {"tool_parser_options": {"a": 1}}},
            {"chat": {"tool_parser": {"name": "hermes", "options": {"a": 1}}}},
        ),
        (
            {"chat": {"reasoning_parser": "think", "reasoning_parser_options": {"starts_in_reasoning": True}}},
            {"chat": {"reasoning_parser": {"name": "think", "options": {"starts_in_reasoning": True}}}},
        ),
    ],
)
def test_a_renamed_key_still_reads_with_a_warning_naming_its_new_key(old, new):
    with pytest.warns(FutureWarning, match=r"deprecated and read until patchbay 0\.2: use "):
        settings = Settings.model_validate(old)
    assert settings.model_dump(exclude_defaults=True) == Settings.model_validate(new).model_dump(exclude_defaults=True)


def test_a_renamed_key_beside_its_new_one_is_an_error_naming_both(write_yaml):
    path = write_yaml("attention: {name: reference, backend: flex}\n")
    with pytest.raises(ConfigError, match="backend .deprecated. and name both given; keep name"):
        load_settings(path)


def test_every_plugin_choice_has_a_name_and_options_key_and_takes_a_name_alone():
    from patchbay.contract.kinds import KINDS
    from patchbay.contract.settings import PluginChoice

    every_choice_given = {
        "attention": {"metadata_builder": "common"},
        "spec_decode": {"name": "ngram"},
        "kv_connector": {"name": "host_offload"},
        "lora": {"resolver": "directory"},
        "chat": {"reasoning_parser": "think"},
        "pooling": {"name": "mean"},
    }
    dumped = Settings.model_validate(every_choice_given).model_dump()
    sites = [site for kind in KINDS.values() for site in kind.choices]
    assert sites
    for site in sites:
        choice = dumped
        for part in site.path:
            choice = choice[part]
        assert {"name", "options"} <= set(choice), f"{site.dotted} is not chosen by name and options: {choice}"
    shorthand = Settings.model_validate({"chat": {"tool_parser": "mistral"}, "lora": {"kernel": "torch"}})
    assert shorthand.chat.tool_parser == PluginChoice(name="mistral")
