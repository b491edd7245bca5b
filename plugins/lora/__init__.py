"""The built-in LoRA plugins: the ``torch`` kernel and the ``directory`` adapter resolver."""
