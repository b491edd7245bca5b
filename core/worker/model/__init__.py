"""Finding, loading and wrapping models, and the forward context through which their attention reaches patchbay."""
