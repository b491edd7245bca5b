"""Measure the routers that can front patchbay's replicas: vllm-router and sglang-router (issue 54).

    .venv/bin/python benchmarks/fleet_routers.py CONFIG.yaml [--requests 200] [--prefixes 8] [--sglang PATH]

Starts ``runtime.data_parallel_size`` replicas of CONFIG (as ``patchbay serve`` does: pinned cores, free
ports), then for each router: fresh replicas, the router in front, ``--requests`` greedy completions sharing
``--prefixes`` long prefixes (8 clients at once), and prints per router the prefix-cache hit rate the replicas'
``/metrics`` report (against one engine's on the same requests), how the requests split, latency, and what
happens when one replica is killed mid-load (failed requests, seconds until requests succeed again, seconds
until the restarted replica gets traffic).  Timings on a shared machine are noisy; the hit rates are not.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from patchbay.contract.registry import registry_for
from patchbay.contract.settings import load_settings
from patchbay.entrypoints.serve.state import model_name_of
from patchbay.entrypoints.serve.fleet.command import free_port, plan_replicas
from patchbay.entrypoints.serve.fleet.replicas import ReplicaSet
from patchbay.entrypoints.serve.fleet.router import RouterProcess, router_command, router_program

WORDS = "river stone cloud amber field lantern orbit copper meadow signal harbor violet quiet engine".split()


def workload(requests: int, prefixes: int, seed: int = 54) -> list[str]:
    rng = random.Random(seed)
    heads = [" ".join(rng.choice(WORDS) for _ in range(180)) for _ in range(prefixes)]
    return [f"{rng.choice(heads)} question {index}:" for index in range(requests)]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def served(url: str) -> float:
    """Requests a replica finished (all finish reasons), from its ``vllm:request_success_total``."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total"))


def complete(url: str, model: str, prompt: str) -> tuple[bool, float, str]:
    started = time.monotonic()
    try:
        response = httpx.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        ok = response.status_code == 200
        return ok, time.monotonic() - started, "" if ok else f"{response.status_code} {response.text[:200]}"
    except httpx.HTTPError as exc:
        return False, time.monotonic() - started, f"{type(exc).__name__}: {exc}"


def run_load(url: str, model: str, prompts: list[str], clients: int = 8) -> list[tuple[bool, float, str]]:
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda prompt: complete(url, model, prompt), prompts))


def sglang_command(program: str, port: int, urls: list[str]) -> list[str]:
    return [
        program, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
        "--policy", "cache_aware", "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        "--health-success-threshold", "1", "--disable-retries", "--prometheus-port", str(free_port()),
    ]  # fmt: skip


def wait_routing(url: str, model: str, timeout: float = 120) -> None:
    """Until the router answers a completion (routers register their workers in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if complete(url, model, "warm-up")[0]:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the router at {url} routed nothing in {timeout} s")


def measure(name: str, settings, config: str, prompts: list[str], router_for) -> dict:  # noqa: ANN001
    replicas = plan_replicas(settings, config, [])
    replica_set = ReplicaSet(replicas, 1.0)
    replica_set.start()
    router = None
    try:
        replica_set.wait_until_healthy(600)
        port = free_port()
        router = subprocess.Popen(router_for(replicas, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        model = model_name_of(settings)  # not the router's /v1/models: sglang-router's says "unknown"
        wait_routing(url, model)
        started = time.monotonic()
        results = run_load(url, model, prompts)
        wall = time.monotonic() - started
        hits = sum(metric(r.url, "patchbay_prefix_cache_hits_total") for r in replicas)
        queries = sum(metric(r.url, "patchbay_prefix_cache_queries_total") for r in replicas)
        split = [served(r.url) for r in replicas]
        latencies = sorted(seconds for ok, seconds, _ in results if ok)
        outcome = {
            "router": name,
            "ok": sum(ok for ok, _, _ in results),
            "hit_rate": hits / queries if queries else 0.0,
            "split": split,
            "wall_s": round(wall, 1),
            "p50_s": round(statistics.median(latencies), 3) if latencies else None,
        }
        outcome.update(kill_one(url, model, prompts, replica_set, RouterProcess([], url)))
        return outcome
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        replica_set.stop(30)


def kill_one(url, model, prompts, replica_set, router: RouterProcess) -> dict:  # noqa: ANN001
    """SIGKILL replica 1 while 8 clients send, supervising as ``patchbay serve`` does (the router's worker list
    follows the deaths and restarts; both routers have ``/remove_worker`` and ``/add_worker``); count failures,
    and time until the restarted replica serves requests through the router again."""
    victim = replica_set.replicas[1]
    pool = concurrent.futures.ThreadPoolExecutor(8)
    futures = [pool.submit(complete, url, model, prompt) for prompt in prompts[:80]]
    time.sleep(1.0)
    victim.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    back = None
    deadline = time.monotonic() + 120
    round_seed = 0
    while back is None and time.monotonic() < deadline:
        changes = replica_set.supervise_once()
        for replica in changes.died:
            router.remove_worker(replica.url)
        for replica in changes.back:
            router.add_worker(replica.url)
        if victim.restart_at is None and not victim.awaiting_health and all(f.done() for f in futures):
            if served(victim.url) > 0:
                back = time.monotonic() - killed_at
                break
            round_seed += 1  # new prefixes, 8 clients: cache_aware spreads them by load
            run_load(url, model, workload(16, 16, seed=round_seed))
        time.sleep(0.2)
    results = [future.result() for future in futures]
    failures = [detail for ok, _, detail in results if not ok]
    pool.shutdown()
    return {"killed_failures": len(failures), "failure_example": failures[:1], "restarted_serving_after_s": back}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--sglang", default=str(Path(sys.executable).with_name("sglang-router")))
    parser.add_argument("--only", nargs="*", help="measure only the routers whose names contain these words")
    args = parser.parse_args()
    settings = load_settings(args.config, registry=registry_for)
    prompts = workload(args.requests, args.prefixes)
    vllm = router_program(settings.router.executable)
    model = model_name_of(settings)

    def with_policy(policy: str):  # noqa: ANN202 - Settings
        return settings.model_copy(update={"router": settings.router.model_copy(update={"policy": policy})})

    def vllm_router(policy: str):  # noqa: ANN202
        return lambda replicas, port: router_command(with_policy(policy), replicas, vllm, port, free_port(), model)

    def sglang_router(replicas, port):  # noqa: ANN001, ANN202
        return sglang_command(args.sglang, port, [replica.url for replica in replicas])

    runs = [(f"vllm-router {p}", with_policy(p), vllm_router(p)) for p in ("cache_aware", "kv_aware", "round_robin")]
    if Path(args.sglang).exists():
        runs.append(("sglang-router cache_aware", settings, sglang_router))
    if args.only:
        runs = [run for run in runs if any(word in run[0] for word in args.only)]
    one = settings.model_copy(update={"runtime": settings.runtime.model_copy(update={"data_parallel_size": 1})})
    single = ReplicaSet(plan_replicas(one, args.config, []), 1.0)
    single.start()
    try:
        single.wait_until_healthy(600)
        replica = single.replicas[0]
        model = httpx.get(f"{replica.url}/v1/models").json()["data"][0]["id"]
        run_load(replica.url, model, prompts)
        hits = metric(replica.url, "patchbay_prefix_cache_hits_total")
        queries = metric(replica.url, "patchbay_prefix_cache_queries_total")
        print(json.dumps({"router": "one engine", "hit_rate": hits / queries}), flush=True)
    finally:
        single.stop(30)
    for name, run_settings, router_for in runs:
        print(json.dumps(measure(name, run_settings, args.config, prompts, router_for)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
