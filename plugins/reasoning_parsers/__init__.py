"""Built-in reasoning parsers: ``<think> ... </think>``."""
