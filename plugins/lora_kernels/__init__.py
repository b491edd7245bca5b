"""The built-in LoRA kernel: ``torch``, each row's adapter applied with grouped matrix products."""
