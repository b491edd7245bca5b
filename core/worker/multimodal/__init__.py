"""Images in the runner's step: the encoder-output cache, M-RoPE positions, and merging image rows into embeddings."""
