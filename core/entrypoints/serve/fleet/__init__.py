"""``patchbay serve`` past one engine: data-parallel replicas on their own cores behind vLLM's router, supervised."""
