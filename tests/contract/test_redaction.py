"""Redaction as one mechanism (issue 30): a distinctive secret set in every secret-bearing setting never shows in
any output surface: ``config show``, configuration errors (exceptions' text), the run summary and the logs at
debug level.  Every path goes through ``patchbay.contract.redaction``."""

from __future__ import annotations

import json
import logging
import socket

import pytest

from patchbay.contract.redaction import redact_assignment
from patchbay.entrypoints import cli

SECRET = "Sekr1t-Xyzzy-0123456789"


def _closed_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


def _secret_flags(tmp_path) -> list[str]:
    key_file = tmp_path / f"{SECRET}.key"
    key_file.write_text(SECRET + "\n")
    key_file.chmod(0o600)
    url = f"redis://patchbay:{SECRET}@127.0.0.1:{_closed_port()}/0?password={SECRET}"
    return [
        "--set",
        f"server.api_keys=[{SECRET}]",
        "--set",
        "kv_connector.name=redis",
        "--set",
        f"kv_connector.options.url={url}",
        "--set",
        f"kv_connector.options.auth_key={SECRET}",
        "--set",
        "kv_connector.options.timeout_s=0.2",
    ], key_file


def test_config_show_hides_every_secret_setting(tmp_path, capsys):
    """SEC (issue 30): config show printed server.api_keys; no secret-bearing setting shows."""
    flags, key_file = _secret_flags(tmp_path)
    (tmp_path / "job.yaml").write_text("{}\n")
    assert (
        cli.main(
            [
                "config",
                "show",
                str(tmp_path / "job.yaml"),
                *flags,
                "--set",
                f"kv_connector.options.auth_key_file={key_file}",
            ]
        )
        == 0
    )
    shown = capsys.readouterr()
    assert SECRET not in shown.out + shown.err
    assert "redis://patchbay:***@127.0.0.1" in shown.out


@pytest.mark.parametrize(
    "flag",
    [
        f"server.api_keys={{a: {SECRET}}}",
        f"kv_connector.options.auth_key=[{SECRET}]",
        "kv_connector.options.auth_key=1234567890123456789",
        f"kv_connector.options.url=[redis://u:{SECRET}@h:1/0]",
        f"kv_connector.options.url={{u: redis://u:{SECRET}@h:1/0}}",
    ],
)
def test_configuration_errors_never_quote_a_secret(tmp_path, capsys, flag):
    """SEC (issue 30): an invalid secret setting's error quoted the --set flag and the value it refused."""
    (tmp_path / "job.yaml").write_text("{}\n")
    assert (
        cli.main(["config", "validate", str(tmp_path / "job.yaml"), "--set", "kv_connector.name=redis", "--set", flag])
        == 2
    )
    error = capsys.readouterr().err
    assert "invalid configuration" in error
    assert SECRET not in error and "1234567890123456789" not in error


def test_a_plain_set_flag_still_shows_its_value():
    assert redact_assignment("scheduler.max_num_seqs", "8") == "scheduler.max_num_seqs=8"
    assert (
        redact_assignment("kv_connector.options.url", "redis://u:pw@h:1/0")
        == "kv_connector.options.url=redis://u:***@h:1/0"
    )


def test_a_run_with_every_secret_set_never_prints_one(tmp_path, tiny_llama, capsys, caplog):
    """SEC (issue 30): the run summary, its errors and every log record at debug level, with a KV connector whose
    Redis cannot be reached (so it logs), never show a secret."""
    flags, _ = _secret_flags(tmp_path)
    (tmp_path / "job.yaml").write_text(
        json.dumps(
            {
                "model": {"path": str(tiny_llama), "max_model_len": 128},
                "cache": {"num_blocks": 64},
                "attention": {"name": "torch_sdpa"},
                "inputs": {
                    "chat_template": False,
                    "prompts": [" ".join(["a prompt of a few blocks"] * 12)],
                    "sampling": {"max_tokens": 3},
                },
                "outputs": {"path": str(tmp_path / "out.jsonl"), "progress": False},
            }
        )
    )
    caplog.set_level(logging.DEBUG)
    status = cli.main(["run", str(tmp_path / "job.yaml"), *flags])
    shown = capsys.readouterr()
    assert status == 0, shown.err
    assert "kv connector" in shown.out  # the summary ran, with the connector
    records = "\n".join(f"{record.getMessage()} {record.exc_text or ''}" for record in caplog.records)
    assert "redis://patchbay:***@127.0.0.1" in records  # the connector did log its unreachable server
    for surface in (shown.out, shown.err, records, (tmp_path / "out.jsonl").read_text()):
        assert SECRET not in surface
