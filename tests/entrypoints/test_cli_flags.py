"""The typed flags of ``patchbay serve``, ``run`` and ``chat``: generated from the settings fields, named in
``--help`` with their keys, landing on those keys between the environment and ``--set``, and errors naming
the flag; ``MODEL`` as a model directory, a ``.gguf`` file, ``default`` or a settings file."""

from __future__ import annotations

import argparse

import pytest

from patchbay.contract.settings import ConfigError, Settings, load_settings
from patchbay.entrypoints.cli import build_parser
from patchbay.entrypoints.cli_flags import FLAGS, flag_sources, model_argument, settings_field


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def settings_of(argv: list[str], *, yaml_path: str | None = None) -> Settings:
    """The settings ``patchbay serve ARGV`` would run with (without a registry)."""
    args = build_parser().parse_args(["serve", *argv])
    config, model = model_argument(args.model, args.config or yaml_path)
    return load_settings(config, overrides=args.set or [], flags=[*model, *flag_sources(args)])


@pytest.fixture(autouse=True)
def no_patchbay_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [key for key in os.environ if key.startswith("PATCHBAY_")]:
        monkeypatch.delenv(key)


def test_every_flag_names_a_settings_key():
    for flag in FLAGS:
        settings_field(flag.key)  # raises KeyError naming the key
    with pytest.raises(KeyError, match="model.max_len: no settings key 'max_len'"):
        settings_field("model.max_len")


@pytest.mark.parametrize("command", ["serve", "run", "chat"])
def test_help_lists_each_flag_of_the_command_with_its_settings_key(command):
    text = " ".join(subparser(command).format_help().split())
    for flag in FLAGS:
        if command in flag.commands:
            assert flag.name in text, flag.name
            assert f"[{flag.key}" in text, flag.key
        else:
            assert f"{flag.name} " not in text, flag.name


def test_help_text_and_choices_come_from_the_settings_field():
    text = " ".join(subparser("serve").format_help().split())
    assert "--max-model-len N Longest prompt plus output, in tokens. [model.max_model_len]" in text
    assert "--dtype {auto,float32,bfloat16,float16}" in text
    assert "--max-num-seqs N Most requests running at once. [scheduler.max_num_seqs; default 64]" in text


def test_the_flags_land_on_their_keys(tmp_path):
    sql, chat = tmp_path / "sql", tmp_path / "chat"
    sql.mkdir()
    chat.mkdir()
    settings = settings_of(
        [
            "--port",
            "9001",
            "--host",
            "0.0.0.0",
            "--served-model-name",
            "123",
            "--max-model-len",
            "4096",
            "--dtype",
            "float32",
            "--api-key",
            "k1",
            "--api-key",
            "k2",
            "--no-enable-prefix-caching",
            "--kv-cache-memory",
            "512MiB",
            "--tool-call-parser",
            "llama3_json",
            "--lora-modules",
            f"sql={sql}",
            f"chat={chat}",
        ]
    )
    assert (settings.server.port, settings.server.host, settings.server.served_model_name) == (9001, "0.0.0.0", "123")
    assert (settings.model.max_model_len, settings.model.dtype) == (4096, "float32")
    assert settings.server.api_keys == ["k1", "k2"]
    assert settings.cache.prefix_caching is False and settings.cache.memory == 512 << 20
    assert settings.chat.tool_parser.name == "llama3_json"
    assert settings.lora is not None and settings.lora.adapters == {"sql": sql, "chat": chat}


def test_enable_lora_gives_the_section_with_its_defaults():
    assert settings_of([]).lora is None
    lora = settings_of(["--enable-lora"]).lora
    assert lora is not None and lora.adapters == {} and lora.max_loras == 4


def test_flags_override_the_file_and_the_environment_and_set_overrides_them(tmp_path, monkeypatch):
    config = tmp_path / "job.yaml"
    config.write_text("scheduler: {max_num_seqs: 16, max_num_batched_tokens: 512}\nserver: {port: 7000}\n")
    monkeypatch.setenv("PATCHBAY_SCHEDULER__MAX_NUM_SEQS", "8")
    settings = settings_of(["--config", str(config), "--max-num-seqs", "4", "--port", "7001"])
    assert settings.scheduler.max_num_seqs == 4 and settings.server.port == 7001
    assert settings.scheduler.max_num_batched_tokens == 512  # the file's, where no flag says otherwise
    settings = settings_of(["--config", str(config), "--max-num-seqs", "4", "--set", "scheduler.max_num_seqs=2"])
    assert settings.scheduler.max_num_seqs == 2


def test_a_bad_value_is_an_error_naming_the_flag_and_its_key():
    with pytest.raises(ConfigError) as caught:
        settings_of(["--max-model-len", "0"])
    assert "--max-model-len 0: model.max_model_len: Input should be greater than 0" in str(caught.value)
    with pytest.raises(ConfigError, match="--kv-cache-memory lots: cache.memory: "):
        settings_of(["--kv-cache-memory", "lots"])
    with pytest.raises(ConfigError, match="--lora-modules sql: lora.adapters: expected NAME=PATH"):
        settings_of(["--lora-modules", "sql"])


def test_a_secret_flag_is_hidden_in_its_label():
    args = build_parser().parse_args(["serve", "--api-key", "sk-secret", "--port", "1"])
    assert [label for label, _ in flag_sources(args)] == ["--port 1", "--api-key ***"]


def test_argparse_refuses_a_value_outside_the_fields_choices_or_type(capsys):
    for argv in (["--dtype", "float64"], ["--port", "eighty"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *argv])
    assert "invalid int value: 'eighty'" in capsys.readouterr().err


def test_model_is_a_directory_a_gguf_file_default_or_a_settings_file(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    settings_file = tmp_path / "job.yaml"
    settings_file.write_text("model: {dtype: float32}\n")
    assert settings_of([str(model_dir)]).model.path == str(model_dir)
    assert settings_of([str(gguf)]).model.path == str(gguf)
    assert settings_of(["default"]).model.path == "default"
    assert settings_of([]).model.path == "default"
    from_file = settings_of([str(settings_file)])
    assert (from_file.model.path, from_file.model.dtype) == ("default", "float32")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "no such file or directory"),
        (
            lambda tmp: (tmp / "weights.bin").write_bytes(b"x") and tmp / "weights.bin",
            "a file that is neither a .gguf model",
        ),
        (lambda tmp: (tmp / "folder").mkdir() or tmp / "folder", "a directory without config.json"),
    ],
    ids=["missing", "other-file", "folder-without-config"],
)
def test_a_model_argument_that_is_no_model_is_an_error_naming_it(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ConfigError) as caught:
        model_argument(str(path), None)
    assert f"MODEL {path}: model.path: {message}" in str(caught.value)


def test_a_settings_file_as_model_and_config_at_once_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="--config b.yaml gives one too"):
        model_argument(str(tmp_path / "a.yaml"), "b.yaml")


def test_run_takes_the_engine_flags_and_model(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("inputs: {prompts: [hi]}\n")
    args = build_parser().parse_args(["run", str(config), "--model", "default", "--max-num-seqs", "3"])
    settings = load_settings(args.config, flags=flag_sources(args))
    assert settings.scheduler.max_num_seqs == 3 and settings.model.path == "default"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", str(config), "--port", "1"])  # a server's flag
