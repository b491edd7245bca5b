"""Built-in poolers."""
