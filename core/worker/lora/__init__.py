"""The runner's LoRA room: PEFT adapters loaded, kept in slots and applied to the model's target linears."""
