"""Two hosts simulated on one machine: two network namespaces joined by a veth pair (issue 54).

Host A is 10.254.54.1 and host B 10.254.54.2, each in a namespace of its own whose only link is the pair,
so every byte between them crosses the veth as it would cross a wire; nothing outside the two namespaces is
reachable from them.  Two runs, as docs/fleet.md#across-machines tells operators to start them on real hosts:

- data parallelism: one replica per host, vllm-router on host A in front of both; a client on host A;
- tensor parallelism: the guide's two torchrun lines, node 0 on host A and node 1 on host B, over gloo.

Needs root and ``ip netns`` (Debian's iproute2); skipped with the reason where the sandbox forbids it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_multinode import NUM_TOKENS, PROMPTS, documented_node_commands, on_loopback, write_job
from tiny_models import transformers_greedy

pytestmark = pytest.mark.slow

NAMESPACES = ("pbfleet-a", "pbfleet-b")
LINKS = ("pbfleet-va", "pbfleet-vb")
ADDRESSES = ("10.254.54.1", "10.254.54.2")
BIN = Path(sys.executable).parent


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def remove_namespaces() -> None:
    for namespace in NAMESPACES:
        ip("netns", "del", namespace)  # takes its end of the pair, and so the pair, with it


@pytest.fixture(scope="module")
def hosts() -> Iterator[None]:
    """The two namespaces and their link, or a skip saying why they cannot be made here."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (Debian: apt-get install iproute2)")
    remove_namespaces()  # a run killed before its cleanup
    steps = [
        *(("netns", "add", namespace) for namespace in NAMESPACES),
        ("link", "add", LINKS[0], "type", "veth", "peer", "name", LINKS[1]),
    ]
    for namespace, link, address in zip(NAMESPACES, LINKS, ADDRESSES, strict=True):
        steps += [
            ("link", "set", link, "netns", namespace),
            ("-n", namespace, "addr", "add", f"{address}/24", "dev", link),
            ("-n", namespace, "link", "set", link, "up"),
            ("-n", namespace, "link", "set", "lo", "up"),
        ]
    for step in steps:
        result = ip(*step)
        if result.returncode != 0:
            remove_namespaces()
            pytest.skip(f"`ip {' '.join(step)}` failed here: {result.stderr.strip()}")
    yield
    remove_namespaces()


def on_host(host: int, command: list[str], **kwargs) -> subprocess.Popen:  # noqa: ANN003 - Popen's
    """Start ``command`` on host ``host`` (in its namespace), gloo bound to its end of the link."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": LINKS[host], "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env = {key: value for key, value in env.items() if not key.startswith("PATCHBAY_")}
    return subprocess.Popen(["ip", "netns", "exec", NAMESPACES[host], *command], env=env, **kwargs)


def test_tensor_parallel_ranks_on_two_hosts_over_gloo(hosts, tiny_llama, tmp_path):
    write_job(tmp_path, tiny_llama, max_tokens=NUM_TOKENS, prompts=PROMPTS)
    logs = {node: (tmp_path / f"node{node}.log").open("w") for node in (0, 1)}
    nodes = {}
    for node, words in sorted(documented_node_commands().items()):
        command = on_loopback(words, 29554)  # the guide's line with this venv's torchrun; then node 0's address:
        command[command.index("--master-addr") + 1] = ADDRESSES[0]
        nodes[node] = on_host(node, command, cwd=tmp_path, stdout=logs[node], stderr=subprocess.STDOUT)
    try:
        status = {node: process.wait(180) for node, process in nodes.items()}
    finally:
        for process in nodes.values():
            if process.poll() is None:
                process.kill()
    text = {node: (tmp_path / f"node{node}.log").read_text(errors="replace") for node in (0, 1)}
    assert status == {0: 0, 1: 0}, f"node 0:\n{text[0][-3000:]}\nnode 1:\n{text[1][-3000:]}"
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    tokens = [result["token_ids"] for result in sorted(results, key=lambda r: int(r["id"]))]
    assert tokens == transformers_greedy(tiny_llama, PROMPTS, NUM_TOKENS)


CLIENT = """
import json, sys, openai, httpx
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none", max_retries=0, timeout=120)
texts = [client.completions.create(model="tiny", prompt=f"host check {i}:", max_tokens=4, temperature=0)
         .choices[0].text for i in range(8)]
served = []
for url in sys.argv[2:]:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    served.append(sum(float(l.rsplit(" ", 1)[1]) for l in lines if l.startswith("vllm:request_success_total")))
print(json.dumps({"texts": texts, "served": served}))
"""


def test_one_replica_per_host_behind_the_router(hosts, tiny_llama, tmp_path):
    config = tmp_path / "replica.yaml"
    config.write_text(
        f"model: {{path: {tiny_llama}, dtype: float32}}\ncache: {{num_blocks: 256}}\n"
        "server: {served_model_name: tiny}\nruntime: {data_parallel_size: 2, threads: 1}\n"
    )
    replicas = [f"http://{address}:8101" for address in ADDRESSES]
    processes = []
    try:
        for host, address in enumerate(ADDRESSES):
            command = [
                sys.executable, "-m", "patchbay.entrypoints.serve.fleet.replica", str(config),
                "--set", f"runtime.data_parallel_rank={host}", "--set", f"server.host={address}",
                "--set", "server.port=8101",
            ]  # fmt: skip
            processes.append(on_host(host, command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        router_url = f"http://{ADDRESSES[0]}:8100"
        router = [
            str(BIN / "vllm-router"), "--host", ADDRESSES[0], "--port", "8100", "--worker-urls", *replicas,
            "--policy", "round_robin", "--worker-startup-check-interval", "1", "--prometheus-port", "29564",
        ]  # fmt: skip
        if not Path(router[0]).exists():
            pytest.skip("vllm-router is not installed (pip install 'patchbay[fleet]')")
        processes.append(on_host(0, router, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline, answer = time.monotonic() + 240, None
        while answer is None:
            client = on_host(
                0, [sys.executable, "-c", CLIENT, router_url, *replicas], stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            out, err = client.communicate(timeout=180)
            if client.returncode == 0:
                answer = json.loads(out)
            elif time.monotonic() > deadline:
                raise AssertionError(f"no answer through the router on host A: {err[-2000:]}")
            else:
                time.sleep(2)  # the replicas are still loading
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
    assert len(answer["texts"]) == 8 and all(isinstance(text, str) for text in answer["texts"])
    assert all(count > 0 for count in answer["served"]), f"a host's replica served nothing: {answer['served']}"
