"""Built-in structured-output (grammar) backends."""
