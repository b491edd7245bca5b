"""The bench's out-of-process peers: the driver protocol against a fake vLLM, the skip-with-reason paths, and
the standard checkpoint handed to other engines.  vLLM itself is never installed or run here."""

from __future__ import annotations

import dataclasses

import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import patchbay
from patchbay.bench.peers import (
    PeerSpec,
    PeerUnavailable,
    SubprocessPeer,
    peer_environment,
    standard_checkpoint,
    vllm_environment,
)
from patchbay.bench.workloads import BenchRequest, Workload
from repo_paths import REPO_ROOT

# A stand-in for the vllm package: the parts of its API the driver uses.  Request ``i`` of a prompt yields
# tokens (sum(prompt) + step) % 1000; it refuses sampling other than greedy-without-EOS, and records
# the most requests it ever held unfinished.
FAKE_VLLM = """
import json, os
__version__ = "0.0.fake"

class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

class _Output:
    def __init__(self, request_id, tokens, finished):
        self.request_id, self.finished = request_id, finished
        self.outputs = [type("Completion", (), {"token_ids": tokens})()]

class _Engine:
    def __init__(self):
        self.requests, self.most = {}, 0

    def add_request(self, request_id, prompt, params, lora_request=None):
        if not prompt["prompt_token_ids"]:
            raise ValueError("empty prompt")
        assert params.kwargs == {"max_tokens": params.kwargs["max_tokens"], "ignore_eos": True, "temperature": 0.0}
        # An adapter shifts the tokens by 100 x its id, so a test sees which one each request ran with.
        shift = 100 * lora_request.lora_int_id if lora_request is not None else 0
        self.requests[request_id] = (sum(prompt["prompt_token_ids"]) + shift, params.kwargs["max_tokens"], [])
        self.most = max(self.most, len(self.requests))
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as record:
            json.dump({"most_unfinished": self.most}, record)

    def step(self):
        outputs = []
        for request_id, (base, wanted, tokens) in list(self.requests.items()):
            tokens.append((base + len(tokens)) % 1000)
            outputs.append(_Output(request_id, list(tokens), len(tokens) == wanted))
            if len(tokens) == wanted:
                del self.requests[request_id]
        return outputs

    def abort_request(self, request_ids):
        for request_id in request_ids:
            self.requests.pop(request_id, None)

class LLM:
    def __init__(self, model, dtype, **kwargs):
        if not os.path.isdir(model):
            raise ValueError(f"no model directory {model}")
        if kwargs.get("enable_lora"):
            assert kwargs["max_loras"] == kwargs["max_cpu_loras"] and kwargs["max_lora_rank"] == 16
        print("fake vLLM log line on standard output")
        self.llm_engine = _Engine()
"""

FAKE_LORA_REQUEST = """
class LoRARequest:
    def __init__(self, lora_name, lora_int_id, lora_path):
        assert lora_int_id > 0, "vLLM's adapter ids start at 1"
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path
"""


def _expected(prompt: list[int], count: int, shift: int = 0) -> list[int]:
    return [(sum(prompt) + shift + step) % 1000 for step in range(count)]


@pytest.fixture()
def fake_peer_python(tmp_path: Path) -> Path:
    """An 'interpreter' that runs this Python with the fake vllm package importable, as a peer's venv would."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (site / "vllm" / "lora").mkdir()
    (site / "vllm" / "lora" / "__init__.py").write_text("")
    (site / "vllm" / "lora" / "request.py").write_text(FAKE_LORA_REQUEST)
    python = tmp_path / "peer-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python


def _spec(python: Path, model: Path, backend: str = "vllm") -> PeerSpec:
    return PeerSpec(backend, python, str(model), "float32", max_model_len=512, max_num_seqs=8)


def test_driver_runs_the_workload_on_token_ids_at_its_concurrency(fake_peer_python, tmp_path, monkeypatch):
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    peer = SubprocessPeer(_spec(fake_peer_python, tmp_path))
    try:
        assert peer.name == "vLLM-CPU 0.0.fake (float32)" and peer.load_seconds >= 0
        requests = [BenchRequest([3, 1, 4, 1, 5][: 1 + i % 5], 2 + i % 4) for i in range(7)]
        run = peer.run(Workload("throughput", requests, concurrency=3, label="concurrency 3"))
        assert run.token_ids == [_expected(r.prompt_token_ids, r.max_tokens) for r in requests]
        assert json.loads(record.read_text())["most_unfinished"] == 3
        assert run.seconds > 0 and run.details["dtype"] == "float32" and run.details["mean_ttft_s"] > 0
        # The process stays up: a second workload runs without a reload.
        again = peer.run(Workload("latency", requests[:1], concurrency=1))
        assert again.token_ids == [_expected(requests[0].prompt_token_ids, requests[0].max_tokens)]
        assert "fake vLLM log line" in peer.log_tail()  # the peer's prints went to the log, not the protocol
    finally:
        peer.close()


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped), once it has settled after a signal."""
    for _ in range(200):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state != "R":
            return state
        time.sleep(0.01)
    return state


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_peer_is_paused_while_it_is_not_measured(fake_peer_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    peer = SubprocessPeer(_spec(fake_peer_python, tmp_path))
    pid = peer._process.pid
    try:
        assert os.getpgid(pid) == pid  # its own group: the engine processes it starts are paused with it
        assert _state(pid) == "T"
        requests = [BenchRequest([2, 7], 3)]
        assert peer.run(Workload("latency", requests, concurrency=1)).token_ids == [_expected([2, 7], 3)]
        assert _state(pid) == "T"
    finally:
        peer.close()
    assert peer._process.returncode == 0  # resumed, it read the end of its input and exited


def test_each_request_reaches_the_peer_with_its_lora_adapter(fake_peer_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    adapters = (("first", str(tmp_path / "a")), ("second", str(tmp_path / "b")))
    spec = dataclasses.replace(_spec(fake_peer_python, tmp_path), lora_adapters=adapters)
    peer = SubprocessPeer(spec)
    try:
        assert peer.name == "vLLM-CPU 0.0.fake (float32) with 2 LoRA adapters"
        names = [None, "first", "second", "first"]
        requests = [BenchRequest([7, i], 3, lora=name) for i, name in enumerate(names)]
        run = peer.run(Workload("lora", requests, concurrency=4))
        shifts = {None: 0, "first": 100, "second": 200}
        assert run.token_ids == [_expected(r.prompt_token_ids, 3, shifts[r.lora]) for r in requests]
    finally:
        peer.close()


def test_a_peer_that_fails_to_load_is_unavailable_with_its_error(fake_peer_python, tmp_path):
    with pytest.raises(PeerUnavailable, match="ValueError: no model directory"):
        SubprocessPeer(_spec(fake_peer_python, tmp_path / "missing"))


def test_a_missing_interpreter_or_package_is_a_reason_not_an_error(tmp_path):
    with pytest.raises(PeerUnavailable, match=r"no interpreter at .*nowhere.*make bench-peers"):
        SubprocessPeer(_spec(tmp_path / "nowhere" / "python", tmp_path))
    # This interpreter has neither peer package (the project's venv never gets them).
    with pytest.raises(PeerUnavailable, match="No module named 'llama_cpp'"):
        SubprocessPeer(_spec(Path(sys.executable), tmp_path, backend="llamacpp"))


def test_vllm_environment_binds_the_threads_and_keeps_the_callers_choices(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    venv_lib = tmp_path / "venv" / "lib" / "python3" / "site-packages" / "vllm" / "libs"
    venv_lib.mkdir(parents=True)
    (venv_lib / "libiomp5.so").touch()
    environment = dict(vllm_environment(tmp_path / "venv" / "bin" / "python", threads=2))
    assert environment["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and environment["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert str(venv_lib / "libiomp5.so") in environment["LD_PRELOAD"].split(":")


def test_a_peer_runs_without_the_wait_policy_patchbay_set_for_itself_but_with_the_users(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(patchbay, "OMP_POLICY_SET_HERE", True)
    set_here = peer_environment()
    assert "OMP_WAIT_POLICY" not in set_here and "PYTHONPATH" not in set_here
    assert set_here["OMP_NUM_THREADS"] == "2"
    monkeypatch.setattr(patchbay, "OMP_POLICY_SET_HERE", False)  # the user's own choice
    assert peer_environment()["OMP_WAIT_POLICY"] == "PASSIVE"


def test_standard_checkpoint_saves_the_tied_embedding_and_names_the_architecture(tiny_llama, tmp_path):
    """The converter's layout (embedding only as the tied lm_head, no architectures) gets a standard copy."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    (weights_file,) = tiny_llama.glob("*.safetensors")
    with safe_open(weights_file, framework="pt") as handle:
        weights = {name: handle.get_tensor(name) for name in handle.keys() if name != "model.embed_tokens.weight"}
    converted = tmp_path / "converted"
    converted.mkdir()
    save_file(weights, converted / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tiny_llama / "config.json").read_text())
    config.pop("architectures")
    config["tie_word_embeddings"] = True
    (converted / "config.json").write_text(json.dumps(config))

    standard = standard_checkpoint(converted, tmp_path / "scratch")
    assert standard != converted
    assert json.loads((standard / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    saved = {}
    for path in standard.glob("*.safetensors"):
        with safe_open(path, framework="pt") as handle:
            saved.update({name: handle.get_tensor(name) for name in handle.keys()})
    assert torch.equal(saved["model.embed_tokens.weight"], weights["lm_head.weight"])
    assert standard_checkpoint(standard, tmp_path / "scratch") == standard  # already standard: used as it is


def test_a_request_the_peer_refuses_fails_that_run_alone(fake_peer_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    peer = SubprocessPeer(_spec(fake_peer_python, tmp_path))
    try:
        refused = [BenchRequest([1, 2], 3), BenchRequest([], 3)]
        with pytest.raises(RuntimeError, match=r"failed on prefix \(x\): ValueError: empty prompt"):
            peer.run(Workload("prefix", refused, concurrency=2, label="x"))
        # The refused run's other request was aborted: the next run gets only its own tokens.
        run = peer.run(Workload("latency", [BenchRequest([1, 2], 2)], concurrency=1))
        assert run.token_ids == [_expected([1, 2], 2)]
        assert json.loads((tmp_path / "record.json").read_text())["most_unfinished"] == 1
    finally:
        peer.close()


@pytest.mark.slow
def test_bench_runs_the_fake_vllm_beside_patchbay_and_skips_an_absent_llamacpp(
    fake_peer_python, tiny_llama, tmp_path, monkeypatch, capsys
):
    from patchbay.entrypoints.cli import main

    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "latency",
            "--model",
            str(tiny_llama),
            "--latency-prompts",
            "16",
            "--threads",
            "2",
            "--dtype",
            "float32",
            "bfloat16",
            "--peers",
            "vllm",
            "llamacpp",
            "--vllm-python",
            str(fake_peer_python),
            "--llamacpp-python",
            str(tmp_path / "absent" / "python"),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert f"skipped llamacpp: no interpreter at {tmp_path / 'absent' / 'python'}" in printed
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    rows = {row["engine"]: row for row in lines if "skipped" not in row}
    assert set(rows) == {
        "patchbay (float32)",
        "patchbay (bfloat16)",
        "vLLM-CPU 0.0.fake (float32)",
        "vLLM-CPU 0.0.fake (bfloat16)",
    }
    assert [row["skipped"] for row in lines if "skipped" in row] == [
        f"no interpreter at {tmp_path / 'absent' / 'python'} (make bench-peers installs it, or point "
        "--llamacpp-python at an interpreter that has it)"
    ]
    for dtype in ("float32", "bfloat16"):
        ours, peer = rows[f"patchbay ({dtype})"], rows[f"vLLM-CPU 0.0.fake ({dtype})"]
        assert ours["dtype"] == peer["dtype"] == dtype and peer["compared_with"] == f"patchbay ({dtype})"
        assert ours["x_vllm"] == pytest.approx(peer["decode_ms_per_token"] / ours["decode_ms_per_token"])
        # The fake's tokens are not the model's: the comparison must say so rather than match by position.
        assert ours["same_first_token_as_patchbay"] == "1/1" and peer["same_tokens_as_patchbay"] == "0/1"
    assert "x vllm" in printed


def _served_script() -> Any:
    import importlib.util

    path = REPO_ROOT / "benchmarks" / "served_vllm.py"
    spec = importlib.util.spec_from_file_location("served_vllm", path)
    assert spec is not None and spec.loader is not None
    served = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(served)
    return served


def test_the_served_comparison_pairs_each_kv_cache_dtype_with_each_quantization(tmp_path):
    from patchbay.contract.settings import load_settings

    served = _served_script()
    servers = served.patchbay_servers("bfloat16", ["none", "w8a8"], ["int8"])
    assert servers == [
        ("patchbay bfloat16", "none", "auto"),
        ("patchbay bfloat16, int8 KV", "none", "int8"),
        ("patchbay bfloat16, w8a8", "w8a8", "auto"),
        ("patchbay bfloat16, w8a8, int8 KV", "w8a8", "int8"),
    ]
    config = served.patchbay_config(tmp_path, "bfloat16", "w8a8", "int8", 8011, 64)
    settings = load_settings(config)
    assert (settings.model.weight_format.name, settings.cache.dtype, settings.server.port) == ("w8a8", "int8", 8011)


def test_the_served_comparison_puts_patchbay_against_vllm_at_each_concurrency():
    served = _served_script()
    rows = {
        "patchbay float32": {16: dict(output_throughput=130.0, median_ttft_ms=50.0, median_tpot_ms=40.0)},
        "vLLM-CPU float32": {16: dict(output_throughput=100.0, median_ttft_ms=100.0, median_tpot_ms=50.0)},
    }
    header, ours, theirs = served.table(rows, "vLLM-CPU float32")
    assert "output tok/s" in header and "median TPOT ms" in header
    # throughput ours / theirs; TTFT and TPOT theirs / ours (above 1: patchbay is faster)
    assert ours.endswith("vs vLLM: 1.30x / 2.00x / 1.25x") and "vs vLLM" not in theirs
