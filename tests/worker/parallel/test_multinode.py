"""Multi-node tensor parallelism through torchrun, as docs/configuration.md tells users to launch it.

The two torchrun command lines of the guide's recipe (node 0 and node 1)
run as two processes on this machine, node 0's address being 127.0.0.1:
two "nodes" on the loopback interface meeting at one rendezvous.  Killing
a "node" kills its torchrun and every process below it, as a machine's
loss would.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch.distributed as dist
from doc_text import CONFIGURATION, shell_lines
from tiny_models import transformers_greedy

from patchbay.contract.settings import ConfigError, load_settings
from patchbay.worker.parallel.step_channel import ADDRESS_KEY, StepChannelError, StepListener, connect_to_rank_0
from patchbay.worker.parallel.torchrun import TorchrunLaunch, check_world_size, torchrun_launch

PROMPTS = [list(range(10, 17)), [5, 6, 7, 8] * 3]
NUM_TOKENS = 12
BIN = Path(sys.executable).parent


def documented_node_commands() -> dict[int, list[str]]:
    """The guide's torchrun command lines, as argument lists, by ``--node-rank``."""
    commands = {}
    for line in shell_lines(CONFIGURATION.read_text()):
        words = shlex.split(line)
        if words[:1] == ["torchrun"]:
            commands[int(words[words.index("--node-rank") + 1])] = words
    assert sorted(commands) == [0, 1], f"docs/configuration.md should show torchrun for node 0 and 1: {commands}"
    return commands


def on_loopback(words: list[str], port: int) -> list[str]:
    """A documented command line with node 0 at 127.0.0.1:``port``, and torchrun from this interpreter's venv."""
    words = list(words)
    words[words.index("--master-addr") + 1] = "127.0.0.1"
    words[words.index("--master-port") + 1] = str(port)
    torchrun = (
        [str(BIN / "torchrun")] if (BIN / "torchrun").exists() else [sys.executable, "-m", "torch.distributed.run"]
    )
    return torchrun + words[1:]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (``None``: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(current := todo.pop())
        todo += children.get(current, [])
    return tree


def alive(pids: list[int]) -> list[int]:
    """The pids among ``pids`` of processes that still run (zombies have ended)."""
    return [pid for pid in pids if (fields := _stat(pid)) is not None and fields[0] != "Z"]


def write_job(directory: Path, model: Path, *, max_tokens: int, prompts: list[list[int]], server_port: int = 0) -> None:
    """The guide's ``job.yaml``, for the tiny model: two ranks, one thread each (both "nodes" share this machine)."""
    items = "\n".join(f"    - {{prompt_token_ids: {prompt}}}" for prompt in prompts)
    (directory / "job.yaml").write_text(
        textwrap.dedent(f"""\
        server: {{host: 127.0.0.1, port: {server_port}}}
        model: {{path: {model}, dtype: float32, max_model_len: 128}}
        runtime: {{tensor_parallel_size: 2, threads: 1, distributed_timeout: 60}}
        cache: {{block_size: 4, num_blocks: 64}}
        scheduler: {{max_num_seqs: 1}}
        inputs:
          sampling: {{max_tokens: {max_tokens}, ignore_eos: true, temperature: 0.0}}
          prompts:
        """)
        + items
        + "\noutputs: {path: results.jsonl}\n"
    )


class Nodes:
    """The two nodes' torchrun processes, logging to files in ``directory``."""

    def __init__(self, directory: Path, command: str = "run") -> None:
        """Run the documented lines, with ``patchbay serve`` instead of ``patchbay run`` if ``command`` says so."""
        port = free_port()
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.logs = {node: directory / f"node{node}.log" for node in (0, 1)}
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        for node, words in sorted(documented_node_commands().items()):
            with self.logs[node].open("w") as log:
                words = [command if word == "run" else word for word in words]
                self.processes[node] = subprocess.Popen(
                    on_loopback(words, port), cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT
                )

    def log(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def wait(self, node: int, timeout: float = 90) -> int:
        return self.processes[node].wait(timeout)

    def processes_of(self, node: int) -> list[int]:
        """The node's torchrun and every process it started, while it runs."""
        return process_tree(self.processes[node].pid)

    def kill(self, node: int) -> None:
        """Kill the node's torchrun and every process below it at once."""
        for pid in self.processes_of(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.processes[node].wait()

    def close(self) -> None:
        """Kill whatever is left of both nodes."""
        for node, process in self.processes.items():
            if process.poll() is None:
                self.kill(node)


@pytest.fixture
def launch_nodes() -> Iterator[Callable[..., Nodes]]:
    """Start both nodes in a directory; whatever is left of them is killed after the test."""
    launched: list[Nodes] = []

    def launch(directory: Path, command: str = "run") -> Nodes:
        launched.append(Nodes(directory, command))
        return launched[-1]

    yield launch
    for nodes in launched:
        nodes.close()


@pytest.mark.slow
def test_the_documented_two_node_recipe_runs_one_job(
    tiny_llama: Path, tmp_path: Path, launch_nodes: Callable[..., Nodes]
) -> None:
    write_job(tmp_path, tiny_llama, max_tokens=NUM_TOKENS, prompts=PROMPTS)
    nodes = launch_nodes(tmp_path)
    status = {node: nodes.wait(node) for node in (0, 1)}
    assert status == {0: 0, 1: 0}, f"node 0:\n{nodes.log(0)[-3000:]}\nnode 1:\n{nodes.log(1)[-3000:]}"
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [result["token_ids"] for result in sorted(results, key=lambda r: int(r["id"]))] == transformers_greedy(
        tiny_llama, PROMPTS, NUM_TOKENS
    )
    assert "results:" in nodes.log(0) and "results:" not in nodes.log(1)  # only rank 0 ran the job


@pytest.mark.slow
def test_killing_node_1_fails_node_0_naming_rank_1_and_leaves_no_process(
    tiny_llama: Path, tmp_path: Path, launch_nodes: Callable[..., Nodes]
) -> None:
    # One request at a time, each the longest the model allows: the job runs long after the ranks are built.
    write_job(tmp_path, tiny_llama, max_tokens=120, prompts=PROMPTS[:1] * 8)
    nodes = launch_nodes(tmp_path)
    deadline = time.monotonic() + 90
    while "requests:" not in nodes.log(0):  # rank 0's progress bar: the engine and every rank are built
        assert nodes.processes[0].poll() is None and time.monotonic() < deadline, nodes.log(0)[-3000:]
        time.sleep(0.1)
    both = nodes.processes_of(0) + nodes.processes_of(1)
    assert len(both) >= 4, "each node runs torchrun and its rank"
    nodes.kill(1)
    started = time.monotonic()
    assert nodes.wait(0, timeout=60) != 0
    print(f"node 0 ended {time.monotonic() - started:.2f} s after node 1 was killed")
    assert "patchbay: error: tensor-parallel rank 1 (launched by torchrun)" in nodes.log(0), nodes.log(0)[-3000:]
    assert alive(both) == []


@pytest.mark.slow
def test_patchbay_serve_on_two_nodes_answers_and_both_end_with_node_0(
    tiny_llama: Path, tmp_path: Path, launch_nodes: Callable[..., Nodes]
) -> None:
    import httpx

    port = free_port()
    write_job(tmp_path, tiny_llama, max_tokens=NUM_TOKENS, prompts=PROMPTS, server_port=port)
    nodes = launch_nodes(tmp_path, "serve")
    deadline = time.monotonic() + 90
    while True:
        assert nodes.processes[0].poll() is None and time.monotonic() < deadline, nodes.log(0)[-3000:]
        try:
            response = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                timeout=60,
                json={"model": tiny_llama.name, "prompt": "hello world", "max_tokens": 8, "temperature": 0.0},
            )
            break
        except httpx.TransportError:
            time.sleep(0.2)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    both = nodes.processes_of(0) + nodes.processes_of(1)
    nodes.processes[0].send_signal(signal.SIGTERM)  # as Ctrl-C or a supervisor would stop node 0's torchrun
    nodes.wait(0, timeout=60)
    assert nodes.wait(1, timeout=60) == 0, nodes.log(1)[-3000:]
    assert alive(both) == []


def test_a_world_size_other_than_the_rank_count_names_the_setting(tmp_path: Path) -> None:
    launch = torchrun_launch(
        {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    )
    assert launch == TorchrunLaunch(
        rank=1,
        world_size=3,
        local_rank=0,
        local_world_size=3,
        master_addr="127.0.0.1",
        master_port=29500,
        agent_store=False,
        attempt=0,
    )
    settings = load_settings(None, overrides=["runtime.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"runtime\.tensor_parallel_size: torchrun started 3 processes"):
        check_world_size(settings, launch)


def test_without_all_of_torchruns_variables_there_is_no_launch() -> None:
    assert torchrun_launch({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}) is None


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("rank", [0, 1])
def test_patchbay_under_a_wrong_world_size_fails_on_every_rank_before_loading(
    tmp_path: Path, command: str, rank: int
) -> None:
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    (tmp_path / "job.yaml").write_text("inputs: {prompts: [hello]}\n")
    result = subprocess.run(
        [str(BIN / "patchbay"), command, "job.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "runtime.tensor_parallel_size: torchrun started 2 processes" in result.stderr


def test_the_step_channel_admits_only_ranks_that_know_the_secret() -> None:
    store = dist.HashStore()
    listener = StepListener("127.0.0.1", store)
    host, port = store.get(ADDRESS_KEY).decode().rsplit(":", 1)
    stray_saw: list[str] = []
    genuine: list[Connection] = []

    def connect() -> None:
        with Connection(socket.create_connection((host, int(port))).detach()) as stray:
            stray.recv_bytes()
            stray.send_bytes((1).to_bytes(4, "big") + bytes(32))  # claims rank 1 without the secret
            try:
                stray.recv_bytes()
                stray_saw.append("a message")
            except EOFError:
                stray_saw.append("end of file")
        genuine.append(connect_to_rank_0(store, 1))

    client = threading.Thread(target=connect, daemon=True)  # a wrongly admitted stray would leave it waiting
    client.start()
    try:
        connected = listener.accept({1}, timeout=60)
        client.join(60)
        assert stray_saw == ["end of file"] and list(connected) == [1]
        connected[1].send_bytes(b"step")
        assert genuine[0].recv_bytes() == b"step"
        with pytest.raises(StepChannelError, match=r"^tensor-parallel rank 2 did not connect to rank 0 within"):
            listener.accept({2}, timeout=0.2)
    finally:
        listener.close()
        for connection in genuine:
            connection.close()
