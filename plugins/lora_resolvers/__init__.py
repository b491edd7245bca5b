"""The built-in LoRA adapter resolver: ``directory``, adapter names resolved under a configured folder."""
