"""Every shell example of the docs runs: each command of a ``sh`` block in README.md and docs/ has a row in
:data:`HOW`, and runs the way its row says.

- ``run``: as written, with bash, in a workspace holding links to the repository's ``.venv`` and
  ``benchmarks`` and copies of ``examples/`` and of the files the docs name (``job.yaml`` is the
  configuration guide's complete file); ``env`` only shrinks a run (fewer tokens), never changes it.
- ``serve``: as written until the server's banner, then one request through its printed URL and SIGTERM
  (a clean exit); ports the docs name are swapped for free ones.
- ``chat``: as written, a line typed on its standard input, then ``/exit``.
- ``curl``: as written against one server per page with the page's settings (API key, model name, a
  LoRA adapter), the docs' address swapped for the server's.
- ``parse``: what runs minutes or needs what the suite does not have (vLLM and llama.cpp peers, two
  machines, Redis, a training run) is parsed by its own command-line parser, which refuses an unknown
  flag or value; ``make`` targets are dry-run (``make -n``); ``covered`` names the test that runs it.

A command added to the docs without a row here fails the suite, and so does a row no doc shows any more.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from doc_text import fenced_blocks
from processes import clean_env
from repo_paths import REPO_ROOT

DOC_FILES = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")])
SHELL = ("sh", "bash", "shell", "console")


def documented_commands() -> dict[str, list[str]]:
    """Each command of the docs' shell blocks (continuations joined, comments dropped, spaces normalised) with
    the pages that show it."""
    found: dict[str, list[str]] = {}
    for doc in DOC_FILES:
        for info, body in fenced_blocks(doc.read_text()):
            if (info.split() or [""])[0] not in SHELL:
                continue
            for line in re.sub(r"\\\n\s*", " ", body).splitlines():
                line = re.sub(r"\s+#.*$", "", line.strip())
                if line and not line.startswith("#"):
                    found.setdefault(" ".join(line.split()), []).append(str(doc.relative_to(REPO_ROOT)))
    return found


@dataclass(frozen=True)
class Way:
    """How the suite runs one documented command."""

    kind: str
    """``run``, ``serve``, ``chat``, ``curl``, ``parse``, ``make`` or ``covered``."""
    why: str = ""
    """For ``parse`` and ``covered``: why it is not run here."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment that shrinks a run (``run``, ``serve``, ``chat``)."""
    swap: dict[str, str] = field(default_factory=dict)
    """Text of the command replaced before it runs: an address or port (``{port}``: a free port)."""
    server: str = ""
    """For ``curl``: the server fixture it talks to (``serving``, ``lora``)."""


SHORT = {"PATCHBAY_INPUTS__SAMPLING": '{"max_tokens": 4}'}
"""Runs of the example jobs with 4 tokens an answer instead of 64 (the requests are the same)."""
SMALL_POOL = {"PATCHBAY_CACHE__NUM_BLOCKS": "640"}
"""Servers with a KV pool of 640 blocks (one request of the bundled model's context) instead of half the RAM."""
PEERS = "needs the vLLM and llama.cpp peers (make bench-peers) and minutes of load"
LOAD = "minutes of load on the machine"
SERVING = "http://127.0.0.1:8000"
TWO_NAMESPACES = "tests/worker/parallel/test_two_namespaces.py"

HOW: dict[str, Way] = {
    # README.md
    "make run": Way("make", "runs examples/quickstart.yaml, as the patchbay run row does"),
    "make test": Way("make", "the suite itself"),
    ".venv/bin/patchbay run examples/quickstart.yaml": Way("run", env=SHORT),
    ".venv/bin/patchbay run examples/quickstart.yaml --set scheduler.max_num_seqs=4": Way("run", env=SHORT),
    ".venv/bin/patchbay serve": Way("serve", env={"PATCHBAY_SERVER__PORT": "0", **SMALL_POOL}),
    ".venv/bin/patchbay serve examples/quickstart.yaml --max-num-seqs 32": Way(
        "serve", env={"PATCHBAY_SERVER__PORT": "0", **SMALL_POOL}
    ),
    ".venv/bin/patchbay chat": Way("chat", env=SMALL_POOL),
    ".venv/bin/patchbay bench serve --rates 1 4 inf": Way("parse", LOAD),
    ".venv/bin/patchbay config validate my-job.yaml": Way("run"),
    ".venv/bin/patchbay config show my-job.yaml": Way("run"),
    ".venv/bin/patchbay plugins": Way("run"),
    ".venv/bin/patchbay check attention:torch_sdpa": Way(
        "covered", "tests/plugins/attention runs this suite on torch_sdpa (minutes)"
    ),
    ".venv/bin/patchbay run examples/quickstart.yaml --set spec_decode.name=ngram": Way("run", env=SHORT),
    ".venv/bin/patchbay-train-drafter medusa --minutes 3": Way("parse", "trains for minutes"),
    ".venv/bin/patchbay run examples/disaggregated/producer.yaml": Way("run"),
    ".venv/bin/patchbay bench throughput --out bench-results": Way("parse", LOAD),
    ".venv/bin/patchbay tune": Way("parse", "measures the machine for minutes and replaces its cached tuning"),
    # docs/benchmarks.md
    **{
        command: Way("parse", PEERS)
        for command in (
            "VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/patchbay bench throughput latency --num-requests 32 --prompt-range "
            "16 256 --output-range 16 128 --concurrency 32 --latency-prompts 128 --threads 2 --dtype bfloat16 "
            "--quantization w8a8 int4 --kv-cache-dtype int8 --peers vllm llamacpp --vllm-dtype bfloat16",
            "VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/patchbay bench throughput --num-requests 32 --prompt-range 16 256 "
            "--output-range 128 128 --concurrency 32 --threads 2 --dtype bfloat16 --quantization w8a8 int4 "
            "--kv-cache-dtype int8 --peers vllm --vllm-dtype bfloat16",
            "VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/patchbay bench throughput --num-requests 64 --prompt-range 64 64 "
            "--output-range 128 128 --concurrency 64 --threads 2 --dtype bfloat16 --quantization w8a8 int4 "
            "--kv-cache-dtype int8 --peers vllm --vllm-dtype bfloat16",
            "VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python benchmarks/served_vllm.py --dtype bfloat16 --vllm-dtype "
            "bfloat16 --quantization none w8a8 --kv-cache-dtype int8",
            "VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/patchbay bench throughput --neighbour --num-requests 32 "
            "--prompt-range 16 256 --output-range 16 128 --concurrency 32 --threads 2 --dtype bfloat16 "
            "--quantization w8a8 --peers vllm --vllm-dtype bfloat16",
            ".venv/bin/patchbay bench quality --threads 2 --dtype bfloat16 float32 --quantization w8a8 int4 "
            "--kv-cache-dtype int8 --peers",
            "VLLM_CPU_KVCACHE_SPACE=4 .venv/bin/patchbay bench --model random-135m --contexts 128 2048 8192 --peers "
            "vllm --dtype bfloat16 --vllm-dtype bfloat16 --threads 2",
            "VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/patchbay bench --model-sizes 135m 1b 3b --num-requests 16 "
            "--prompt-range 16 128 --output-range 16 64 --concurrency 16 --threads 2 --dtype bfloat16 --peers vllm "
            "--vllm-dtype bfloat16",
            "VLLM_CPU_KVCACHE_SPACE=4 .venv/bin/patchbay bench --model random-135m --contexts 32768 "
            "--context-requests 1 --peers vllm --dtype bfloat16 --vllm-dtype bfloat16 --threads 2",
            "VLLM_CPU_KVCACHE_SPACE=4 .venv/bin/patchbay bench throughput --concurrency 1 4 16 64 256 --num-requests "
            "256 --prompt-range 16 128 --output-range 16 64 --threads 2 --dtype bfloat16 --peers vllm --vllm-dtype "
            "bfloat16",
            "VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python benchmarks/profile_step.py --requests 32 64 --dtype bfloat16 "
            "--threads 2 --peers vllm --json profile.json",
            ".venv/bin/python benchmarks/profile_step.py --requests 32 64 --dtype bfloat16 --threads 2 --peers vllm",
            ".venv/bin/patchbay bench --model-sizes 135m 1b 3b --peers vllm --out bench-results",
            ".venv/bin/patchbay bench --model random-135m --contexts 128 2048 8192 32768 --peers vllm",
            ".venv/bin/patchbay bench throughput --concurrency 1 4 16 64 256 --num-requests 256 --peers vllm",
            ".venv/bin/patchbay bench throughput --neighbour --peers vllm",
            ".venv/bin/patchbay bench throughput latency --dtype float32 bfloat16 --peers vllm llamacpp",
        )
    },
    "make bench": Way("make", LOAD),
    "make bench-peers": Way("make", "builds vLLM and llama.cpp in virtualenvs of their own"),
    ".venv/bin/patchbay bench throughput": Way("parse", LOAD),
    ".venv/bin/patchbay bench all --model DIR --threads 2 --peers generate": Way("parse", LOAD),
    ".venv/bin/python benchmarks/spec_decode.py --methods none ngram medusa eagle eagle3 --medusa-path DIR/medusa "
    "--eagle-path DIR/eagle --eagle3-path DIR/eagle3 --num-requests 8 --max-tokens 96 --num-speculative-tokens 3": Way(
        "parse", "needs trained drafter heads (patchbay-train-drafter, minutes each)"
    ),
    ".venv/bin/python benchmarks/kv_connectors.py --connectors none host_offload shared_storage redis --redis-url "
    "redis://127.0.0.1:6379/0 --num-requests 4 --prefix-tokens 1000": Way("parse", "needs a Redis server"),
    # docs/configuration.md
    ".venv/bin/patchbay config validate job.yaml": Way("run"),
    ".venv/bin/patchbay config show job.yaml": Way("run"),
    ".venv/bin/patchbay run job.yaml": Way("run", env=SHORT),
    "PATCHBAY_SCHEDULER__MAX_NUM_SEQS=8 .venv/bin/patchbay run job.yaml --set scheduler.max_num_seqs=4": Way(
        "run", env=SHORT
    ),
    "patchbay run examples/disaggregated/producer.yaml": Way("run"),
    "patchbay run examples/disaggregated/consumer.yaml": Way("run"),
    **{
        f"torchrun --nnodes 2 --nproc-per-node 1 --node-rank {rank} --master-addr 10.0.0.1 --master-port 29500 "
        "--no-python patchbay run job.yaml": Way("parse", "needs two machines")
        for rank in (0, 1)
    },
    # docs/design/multimodal.md
    ".venv/bin/python benchmarks/multimodal.py --num-requests 32 --max-tokens 32": Way("parse", LOAD),
    # docs/lora.md
    "curl localhost:8000/v1/load_lora_adapter -H 'Content-Type: application/json' -H \"Authorization: Bearer $KEY\" "
    '-d \'{"lora_name": "sql", "lora_path": "/srv/adapters/sql-lora"}\'': Way(
        "curl", swap={"localhost:8000": "{url}", "/srv/adapters/sql-lora": "{adapter}"}, server="lora"
    ),
    "curl localhost:8000/v1/unload_lora_adapter -H 'Content-Type: application/json' -H \"Authorization: Bearer "
    '$KEY" -d \'{"lora_name": "sql"}\'': Way("curl", swap={"localhost:8000": "{url}"}, server="lora"),
    ".venv/bin/python benchmarks/lora.py": Way("parse", LOAD),
    ".venv/bin/python benchmarks/lora.py --num-requests 5 --max-tokens 4": Way(
        "parse", "builds its adapters with PEFT and loads transformers' model for its reference (minutes)"
    ),
    ".venv/bin/python benchmarks/lora.py --json results.jsonl": Way("parse", LOAD),
    "patchbay plugins --kind lora_kernel -v": Way("run"),
    "patchbay check lora_kernel:torch": Way("covered", "tests/plugins/lora runs this suite on the torch kernel"),
    "patchbay check lora_resolver:directory": Way(
        "covered", "tests/plugins/lora runs this suite on the directory resolver"
    ),
    ".venv/bin/python benchmarks/pooling.py": Way("parse", LOAD),
    # docs/plugin-guide.md
    "PATCHBAY_TEST_KV_CONNECTOR_OPTIONS='{\"max_blocks\": 64}' patchbay check kv_connector:host_offload": Way(
        "covered", "tests/plugins/kv_connectors runs this suite on host_offload with options"
    ),
    "patchbay check --options '{\"starts_in_reasoning\": true}' reasoning_parser:think": Way(
        "covered", "tests/testing/test_check_options.py runs patchbay check with --options before KIND:NAME"
    ),
    "patchbay check reasoning_parser:think --options '{\"starts_in_reasoning\": true}'": Way(
        "covered", "tests/testing/test_check_options.py runs patchbay check with --options after KIND:NAME"
    ),
    "pip install ./patchbay-temperature": Way(
        "covered", "tests/project/test_docs.py writes the guide's plugin out, installs it and runs its kit"
    ),
    "patchbay plugins --kind sampler -v": Way("run"),
    "PATCHBAY_PLUGINS__DENY=patchbay-duplicate-plugin patchbay run job.yaml": Way("run", env=SHORT),
    # docs/serving.md
    '.venv/bin/patchbay serve "$(.venv/bin/patchbay models path default)" --port 9000 --max-model-len 4096': Way(
        "serve", env=SMALL_POOL, swap={"--port 9000": "--port {port}"}
    ),
    ".venv/bin/patchbay serve examples/quickstart.yaml": Way("serve", env={"PATCHBAY_SERVER__PORT": "0", **SMALL_POOL}),
    "PATCHBAY_SERVER__API_KEYS=sk-mine .venv/bin/patchbay serve examples/quickstart.yaml --set server.port=9000": Way(
        "serve", env=SMALL_POOL, swap={"server.port=9000": "server.port={port}"}
    ),
    ".venv/bin/patchbay serve examples/quickstart.yaml --set server.api_key_file=~/.config/patchbay/api-keys": Way(
        "serve", env={"PATCHBAY_SERVER__PORT": "0", **SMALL_POOL}
    ),
    ".venv/bin/patchbay --version": Way("run"),
    ".venv/bin/patchbay models path default": Way("run"),
    "curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -H 'Authorization: Bearer "
    'sk-local-1\' -d \'{"model": "smollm2", "messages": [{"role": "user", "content": "What is 12 times '
    '12?"}], "max_tokens": 32}\'': Way("curl", swap={SERVING: "{url}"}, server="serving"),
    "curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -H 'Authorization: Bearer "
    'sk-local-1\' -d \'{"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 32, "stream": '
    "true}'": Way("curl", swap={SERVING: "{url}"}, server="serving"),
    ".venv/bin/patchbay bench serve --rates 1 2 4 inf --num-requests 32 --prompt-range 16 128 --output-range 16 64 "
    "--concurrency 16 --max-concurrency 16 --out bench-results": Way("parse", LOAD),
    '.venv/bin/patchbay chat --system "Answer in one sentence." --temperature 0': Way("chat", env=SMALL_POOL),
    # docs/fleet.md
    ".venv/bin/patchbay serve examples/quickstart.yaml --data-parallel-size 2": Way(
        "covered", "tests/entrypoints/serve/test_fleet.py serves a tiny model this way (two bundled models: minutes)"
    ),
    **{
        command: Way("covered", f"{TWO_NAMESPACES} runs this between two network namespaces (needs root)")
        for command in (
            *(
                f".venv/bin/python -m patchbay.entrypoints.serve.fleet.replica job.yaml --set "
                f"runtime.data_parallel_size=2 --set runtime.data_parallel_rank={rank} --set "
                f"server.host=10.0.0.{rank + 1} --set server.port=8101"
                for rank in (0, 1)
            ),
            ".venv/bin/vllm-router --host 0.0.0.0 --port 8000 --policy cache_aware --worker-urls http://10.0.0.1:8101 "
            "http://10.0.0.2:8101 --health-check-interval-secs 1 --health-failure-threshold 1 --disable-retries",
            "ip netns add hostA; ip netns add hostB",
            "ip link add vethA type veth peer name vethB",
            "ip link set vethA netns hostA; ip link set vethB netns hostB",
            "ip -n hostA addr add 10.254.54.1/24 dev vethA; ip -n hostB addr add 10.254.54.2/24 dev vethB",
            "ip -n hostA link set vethA up; ip -n hostB link set vethB up",
            "ip -n hostA link set lo up; ip -n hostB link set lo up",
            *(
                f"ip netns exec host{host} env GLOO_SOCKET_IFNAME=veth{host} torchrun --nnodes 2 --nproc-per-node 1 "
                f"--node-rank {rank} --master-addr 10.254.54.1 --master-port 29500 --no-python patchbay run job.yaml"
                for rank, host in enumerate("AB")
            ),
        )
    },
}

DOCUMENTED = documented_commands()
SLOW_KINDS = ("serve", "chat")


def test_every_documented_command_has_a_row_and_every_row_a_command():
    missing = [f"{command}  ({', '.join(pages)})" for command, pages in DOCUMENTED.items() if command not in HOW]
    assert not missing, "shell examples with no row in HOW (say how the suite runs each):\n  " + "\n  ".join(missing)
    stale = [command for command in HOW if command not in DOCUMENTED]
    assert not stale, "rows of HOW no doc shows any more:\n  " + "\n  ".join(stale)


def params(kinds: tuple[str, ...]) -> list:
    return [
        pytest.param(command, id=command[:60], marks=[pytest.mark.slow] if HOW[command].kind in SLOW_KINDS else [])
        for command in DOCUMENTED
        if command in HOW and HOW[command].kind in kinds
    ]


# -- the workspace the commands run in ----------------------------------------------------------------------


def complete_file_example() -> str:
    """The configuration guide's complete file: the yaml block under "A complete file"."""
    text = (REPO_ROOT / "docs" / "configuration.md").read_text()
    section = text.split("## A complete file", 1)[1]
    return next(body for info, body in fenced_blocks(section) if info.split()[:1] == ["yaml"])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder like the repository's root to run the docs' commands in, with a home of its own."""
    root = tmp_path_factory.mktemp("docs-shell")
    (root / ".venv").symlink_to(REPO_ROOT / ".venv", target_is_directory=True)
    (root / "benchmarks").symlink_to(REPO_ROOT / "benchmarks", target_is_directory=True)
    shutil.copytree(REPO_ROOT / "examples", root / "examples")
    (root / "Makefile").symlink_to(REPO_ROOT / "Makefile")
    (root / "pyproject.toml").symlink_to(REPO_ROOT / "pyproject.toml")
    for name in ("job.yaml", "my-job.yaml"):
        (root / name).write_text(complete_file_example())
    keys = root / "home" / ".config" / "patchbay" / "api-keys"
    keys.parent.mkdir(parents=True)
    keys.write_text("# the server's keys\nsk-local-1\n")
    keys.chmod(0o600)
    return root


def environment(workspace: Path, extra: dict[str, str]) -> dict[str, str]:
    from patchbay.toolkit.paths import cache_dir

    # The shared cache keeps the built kernels, the converted bundled model and the CPU's tuning.
    return clean_env(
        HOME=str(workspace / "home"),
        PATCHBAY_CACHE_DIR=str(cache_dir()),
        PATH=f"{REPO_ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
        **extra,
    )


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def swapped(command: str, way: Way, **values: str) -> str:
    for old, new in way.swap.items():
        assert old in command, f"the row swaps {old!r}, which the command does not hold"
        command = command.replace(old, new.format(**values))
    return command


# -- run ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("command", params(("run",)))
def test_a_command_runs_as_written(command: str, workspace: Path):
    way = HOW[command]
    result = subprocess.run(
        ["bash", "-c", command],
        cwd=workspace,
        env=environment(workspace, way.env),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


# -- serve and chat -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def started(command: str, workspace: Path, way: Way) -> Iterator[str]:
    port = str(free_port())
    # exec: the server is bash's process, so SIGTERM reaches it (env takes the command's own assignments).
    launcher = "exec env" if re.match(r"^[A-Z_][A-Z0-9_]*=", command) else "exec"
    process = subprocess.Popen(
        ["bash", "-c", f"{launcher} {swapped(command, way, port=port)}"],
        cwd=workspace,
        env=environment(workspace, way.env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        banner = process.stdout.readline()
        if " on http://" not in banner:
            process.wait(60)
            raise AssertionError(f"{command} did not start: {banner}{process.stderr.read()[-3000:]}")
        yield banner.split(" on ")[1].split("/v1")[0]
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("command", params(("serve",)))
def test_a_serve_command_serves(command: str, workspace: Path):
    with started(command, workspace, HOW[command]) as url:
        keys = {"Authorization": "Bearer sk-mine" if "sk-mine" in command else "Bearer sk-local-1"}
        models = httpx.get(f"{url}/v1/models", headers=keys, timeout=60)
        assert models.status_code == 200, models.text
        body = {"model": models.json()["data"][0]["id"], "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=keys, timeout=300).status_code == 200


@pytest.mark.parametrize("command", params(("chat",)))
def test_a_chat_command_answers_a_typed_line(command: str, workspace: Path):
    result = subprocess.run(
        ["bash", "-c", command],
        cwd=workspace,
        env=environment(workspace, HOW[command].env),
        input="Say hello in two words.\n/exit\n",
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = result.stdout.split(">>> ")[1]
    assert answer.strip(), result.stdout


# -- curl -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serving_server() -> Iterator[str]:
    """docs/serving.md's server: the bundled model as smollm2, behind the key sk-local-1."""
    from serving import running_server

    from patchbay.contract.settings import load_settings

    settings = load_settings(
        None,
        overrides=[
            "cache.num_blocks=640",
            "server.served_model_name=smollm2",
            "server.api_keys=[sk-local-1]",
        ],
    )
    with running_server(settings) as server:
        yield server.url


@pytest.fixture(scope="module")
def lora_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """docs/lora.md's server: runtime adapter updates on, behind a key; and an adapter to load."""
    from lora_adapters import ADAPTER_SPECS, make_peft_adapter
    from serving import running_server

    from patchbay.contract.settings import load_settings

    adapter = make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("sql-lora"), seed=1, **ADAPTER_SPECS["attn-r4"])
    settings = load_settings(
        None,
        overrides=[
            f"model.path={tiny_llama}",
            "cache.num_blocks=64",
            "lora.allow_runtime_updates=true",
            "server.api_keys=[docs-key]",
        ],
    )
    with running_server(settings) as server:
        yield server.url, adapter


@pytest.mark.slow
@pytest.mark.parametrize("command", params(("curl",)))
def test_a_curl_example_gets_a_2xx_answer(command: str, request: pytest.FixtureRequest, workspace: Path):
    way = HOW[command]
    if way.server == "lora":
        url, adapter = request.getfixturevalue("lora_server")
        # The unload example needs the adapter loaded, the load example needs it not yet loaded.
        key = {"Authorization": "Bearer docs-key"}
        names = [model["id"] for model in httpx.get(f"{url}/v1/models", headers=key, timeout=60).json()["data"]]
        wanted = "unload" in command
        if ("sql" in names) != wanted:
            route = "load_lora_adapter" if wanted else "unload_lora_adapter"
            body = {"lora_name": "sql", "lora_path": str(adapter)} if wanted else {"lora_name": "sql"}
            assert httpx.post(f"{url}/v1/{route}", json=body, headers=key, timeout=300).status_code == 200
        run_curl(swapped(command, way, url=url, adapter=str(adapter)), workspace, {"KEY": "docs-key"})
        names = [model["id"] for model in httpx.get(f"{url}/v1/models", headers=key, timeout=60).json()["data"]]
        assert ("sql" in names) != wanted, names
    else:
        url = request.getfixturevalue("serving_server")
        output = run_curl(swapped(command, way, url=url), workspace, {})
        assert '"choices"' in output and ("data: [DONE]" in output or '"usage"' in output), output


def run_curl(command: str, workspace: Path, env: dict[str, str]) -> str:
    # -w appends the status, which curl as written does not print; the command is otherwise the docs'.
    result = subprocess.run(
        ["bash", "-c", f"{command} -s -w '\\nHTTP %{{http_code}}'"],
        cwd=workspace,
        env=environment(workspace, env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    body, _, status = result.stdout.rpartition("\nHTTP ")
    assert status.startswith("2"), f"{command}\n-> {status}: {body}"
    return body


# -- parse, make, covered -------------------------------------------------------------------------------------


class Parsed(Exception):
    """Raised in place of running a command once its parser has taken its arguments."""


def argv_of(command: str) -> list[str]:
    """The command's words after its environment assignments (and a ``torchrun ... --no-python`` launcher)."""
    words = shlex.split(command)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    if words[0] == "torchrun":
        words = words[words.index("--no-python") + 1 :]
    return words


def parse_with_the_scripts_parser(script: Path, arguments: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``script`` as ``__main__`` until its ArgumentParser has parsed ``arguments`` (a bad one: SystemExit)."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN202 - argparse's signature
        original(self, arguments, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [str(script), *arguments])
    with pytest.raises(Parsed):
        runpy.run_path(str(script), run_name="__main__")


@pytest.mark.parametrize("command", params(("parse",)))
def test_a_command_too_long_to_run_here_parses(command: str, monkeypatch: pytest.MonkeyPatch):
    assert HOW[command].why
    words = argv_of(command)
    program = Path(words[0]).name
    if program == "patchbay":
        from patchbay.entrypoints.cli import build_parser

        build_parser().parse_args(words[1:])  # SystemExit(2) on an unknown subcommand, flag or value
    elif program == "patchbay-train-drafter":
        from patchbay.plugins.spec_decode import train_cli

        train_cli.parser().parse_args(words[1:])
    else:
        assert program == "python" and words[1].startswith("benchmarks/"), command
        parse_with_the_scripts_parser(REPO_ROOT / words[1], words[2:], monkeypatch)


@pytest.mark.parametrize("command", params(("make",)))
def test_a_make_target_exists(command: str):
    result = subprocess.run(
        ["make", "-n", *shlex.split(command)[1:]], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", params(("covered",)))
def test_a_covered_command_names_the_test_that_runs_it(command: str):
    test_path = HOW[command].why.split()[0]
    assert (REPO_ROOT / test_path).exists(), f"{command}: no {test_path}"
