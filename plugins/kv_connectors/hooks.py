"""Registers the built-in KV connectors (lazily: nothing is imported until one is chosen)."""

from patchbay import hookimpl


@hookimpl
def register_kv_connectors(register):
    register(
        "host_offload",
        "patchbay.plugins.kv_connectors.host_offload:HostOffloadConnector",
        description="copies computed prompt KV blocks to a bounded LRU in host memory, loads them on a prefix hit",
    )
    register(
        "shared_storage",
        "patchbay.plugins.kv_connectors.shared_storage:SharedStorageConnector",
        description="KV blocks as atomically written files under a directory shared by processes",
    )
    register(
        "redis",
        "patchbay.plugins.kv_connectors.redis_connector:RedisConnector",
        description="KV blocks in a Redis server (key prefix, TTL, size limit) shared across machines",
    )
