"""Built-in KV connectors: host memory, a shared directory and Redis."""
