"""How plugins are declared, found, configured and chosen: hook specs, registry, settings, selection (no torch)."""
