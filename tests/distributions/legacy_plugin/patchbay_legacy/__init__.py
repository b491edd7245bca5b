"""A plugin package built against sampler contract 1.0 (the contract before versioning)."""
