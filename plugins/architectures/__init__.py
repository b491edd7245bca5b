"""Built-in architectures: transformers' classes (the default), MLA (DeepSeek), StableLM."""
