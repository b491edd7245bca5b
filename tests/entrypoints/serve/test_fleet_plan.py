"""What ``patchbay serve --data-parallel-size N`` plans before it starts anything: each replica's cores, command
line and environment, and the router's command line (issue 54).  No process runs here."""

from __future__ import annotations

import pytest

from patchbay.contract.settings import ConfigError, load_settings
from patchbay.entrypoints.cli import build_parser
from patchbay.entrypoints.cli_flags import flag_sources, model_argument
from patchbay.entrypoints.serve.fleet.command import plan_replicas, replica_overrides, sources_as_overrides
from patchbay.entrypoints.serve.fleet.cores import pinned_environment, split_cores
from patchbay.entrypoints.serve.fleet.router import router_command, router_program


def fleet_settings(*overrides: str):
    return load_settings(None, overrides=["runtime.data_parallel_size=2", *overrides])


def test_cores_split_into_disjoint_runs_the_first_ones_longer():
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([4, 5, 6, 7], 4) == [[4], [5], [6], [7]]
    with pytest.raises(ConfigError, match="runtime.data_parallel_size: 3 replicas need a core each"):
        split_cores([0, 1], 3)


def test_a_lone_replica_binds_one_thread_per_core_ranks_share_theirs():
    assert pinned_environment([2, 3], processes=1) == {
        "OMP_NUM_THREADS": "2",
        "OMP_PLACES": "{2},{3}",
        "OMP_PROC_BIND": "close",
    }
    assert pinned_environment([2, 3], processes=2) == {"OMP_NUM_THREADS": "1"}


def test_each_replica_is_the_operators_run_with_its_rank_port_and_threads():
    settings = fleet_settings("router.replica_ports=9101,9102")
    replicas = plan_replicas(settings, "job.yaml", ["scheduler.max_num_seqs=8"])
    assert [(r.rank, r.port, r.url) for r in replicas] == [
        (0, 9101, "http://127.0.0.1:9101"),
        (1, 9102, "http://127.0.0.1:9102"),
    ]
    command = replicas[1].command
    assert command[1:4] == ["-m", "patchbay.entrypoints.serve.fleet.replica", "job.yaml"]
    sets = [command[i + 1] for i, word in enumerate(command) if word == "--set"]
    assert sets[0] == "scheduler.max_num_seqs=8"  # the operator's overrides first, then the replica's
    assert "runtime.data_parallel_rank=1" in sets and "server.port=9102" in sets
    assert f"runtime.threads={len(replicas[1].cores)}" in sets


def test_kv_aware_turns_on_kv_events_and_prefill_replicas_get_their_roles():
    settings = fleet_settings("router.policy=kv_aware")
    assert "kv_events.enable_kv_cache_events=true" in replica_overrides(settings, 0, 9101, [0])
    settings = fleet_settings("router.prefill_replicas=1", "kv_connector.name=shared_storage")
    assert "kv_connector.role=producer" in replica_overrides(settings, 0, 9101, [0])
    assert "kv_connector.role=consumer" in replica_overrides(settings, 1, 9102, [1])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["router.replica_ports=9101"], "router.replica_ports"),
        (["router.prefill_replicas=1"], "router.prefill_replicas"),  # no kv_connector: section
        (["router.prefill_replicas=2", "kv_connector.name=shared_storage"], "router.prefill_replicas"),
    ],
)
def test_impossible_fleets_are_config_errors_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        plan_replicas(fleet_settings(*overrides), None, [])


def test_the_routers_command_line_by_policy_and_mode():
    settings = fleet_settings("router.replica_ports=9101,9102", "server.port=8000", "router.policy=kv_aware")
    replicas = plan_replicas(settings, None, [])
    command = router_command(settings, replicas, "vllm-router", 8000, 29000, "tiny")
    assert command[command.index("--worker-urls") + 1 : command.index("--worker-urls") + 3] == [
        "http://127.0.0.1:9101",
        "http://127.0.0.1:9102",
    ]
    sources = [command[i + 1] for i, word in enumerate(command) if word == "--kv-event-source"]
    assert sources == ["http://127.0.0.1:9101=tcp://127.0.0.1:5557", "http://127.0.0.1:9102=tcp://127.0.0.1:5558"]
    assert "--disable-retries" in command and command[command.index("--policy") + 1] == "kv_aware"

    settings = fleet_settings(
        "router.replica_ports=9101,9102", "router.prefill_replicas=1", "kv_connector.name=shared_storage"
    )
    command = router_command(settings, plan_replicas(settings, None, []), "vllm-router", 8000, 29000, "tiny")
    assert "--vllm-pd-disaggregation" in command and "--worker-urls" not in command
    assert command[command.index("--prefill") + 1] == "http://127.0.0.1:9101"
    assert command[command.index("--decode") + 1] == "http://127.0.0.1:9102"


def test_a_missing_router_program_names_the_setting():
    with pytest.raises(ConfigError, match="router.executable: 'no-such-router' not found"):
        router_program("no-such-router")


def test_the_typed_flags_reach_each_replica_as_overrides(tiny_llama):
    argv = ["serve", str(tiny_llama), "--data-parallel-size", "2", "--max-num-seqs", "8", "--api-key", "k1"]
    argv += ["--api-key", "k 2", "--enable-lora", "--no-enable-prefix-caching", "--served-model-name", "007"]
    args = build_parser().parse_args(argv)
    config, model = model_argument(args.model, args.config)
    sources = [*model, *flag_sources(args)]
    as_flags = load_settings(config, flags=sources)
    as_overrides = load_settings(config, overrides=sources_as_overrides(sources))
    assert as_overrides == as_flags
    assert as_overrides.server.api_keys == ["k1", "k 2"] and as_overrides.server.served_model_name == "007"
    assert as_overrides.lora is not None and as_overrides.runtime.data_parallel_size == 2
