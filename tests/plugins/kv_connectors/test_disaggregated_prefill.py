"""Disaggregated prefill across two processes.

The consumer loads the producer's prompt KV and decodes the same tokens.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from processes import clean_env, patchbay_command
from repo_paths import REPO_ROOT

pytestmark = pytest.mark.slow

EXAMPLES = REPO_ROOT / "examples" / "disaggregated"


def _run(config: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    # float32 weights (the bundled GGUF file's float conversion) in float32: in bfloat16 (the tuned default on
    # some CPUs), or through the file's own blocks (activations rounded to int8 per row), the producer's prefill
    # and a plain run round their products differently (other batch shapes), so "the same tokens" would test
    # rounding, not the transfer.
    from patchbay.toolkit.model_files import resolve_model_dir

    command = [
        *patchbay_command(),
        "run",
        str(EXAMPLES / config),
        "--set",
        "runtime.threads=2",
        "--set",
        "model.dtype=float32",
        "--set",
        f"model.path={resolve_model_dir('default')}",
    ]
    for override in overrides:
        command += ["--set", override]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _token_ids(path: Path) -> dict[str, list[int]]:
    return {row["id"]: row["token_ids"] for row in map(json.loads, path.read_text().splitlines())}


def test_the_consumer_reuses_the_producers_prefill_and_decodes_the_same_tokens(tmp_path):
    store = tmp_path / "store"
    _run("producer.yaml", f"kv_connector.options.path={store}")
    assert any(store.rglob("*.kvb")), "the producer stored no KV blocks"

    consumed = _run("consumer.yaml", f"kv_connector.options.path={store}", f"outputs.path={tmp_path / 'with.jsonl'}")
    loaded = int(re.search(r"kv connector:\s+(\d+) tokens loaded", consumed.stdout).group(1))
    assert loaded > 0

    _run("consumer.yaml", "kv_connector=null", f"outputs.path={tmp_path / 'without.jsonl'}")
    assert _token_ids(tmp_path / "with.jsonl") == _token_ids(tmp_path / "without.jsonl")


def test_a_damaged_store_is_recomputed_not_trusted(tmp_path):
    store = tmp_path / "store"
    _run("producer.yaml", f"kv_connector.options.path={store}")
    for entry in sorted(store.rglob("*.kvb"))[::2]:
        data = bytearray(entry.read_bytes())
        data[-16:] = bytes(16)  # corrupt the payload tail: the checksum no longer matches
        entry.write_bytes(bytes(data))
    consumed = _run("consumer.yaml", f"kv_connector.options.path={store}", f"outputs.path={tmp_path / 'with.jsonl'}")
    assert int(re.search(r"(\d+) blocks recomputed", consumed.stdout).group(1)) > 0, consumed.stdout
    _run("consumer.yaml", "kv_connector=null", f"outputs.path={tmp_path / 'without.jsonl'}")
    assert _token_ids(tmp_path / "with.jsonl") == _token_ids(tmp_path / "without.jsonl")
