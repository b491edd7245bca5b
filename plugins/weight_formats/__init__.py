"""Built-in weight formats: GGUF files as shipped, and float checkpoints re-quantized while loading."""
