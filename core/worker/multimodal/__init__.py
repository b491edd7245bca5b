"""The runner's images: encoder cache, M-RoPE, merged embeddings."""
