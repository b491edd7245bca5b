"""Built-in attention backends and their metadata builders."""
