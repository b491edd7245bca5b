"""LoRA adapters for tests, made by PEFT itself over the tiny models and saved in its format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    # name: LoraConfig keywords; different ranks, target sets and scalings.
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp-r8": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all-r2-rslora": dict(
        r=2,
        lora_alpha=6,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
}


def make_peft_adapter(model_dir: Path, out_dir: Path, *, seed: int, **lora_config: Any) -> Path:
    """Wrap the model at ``model_dir`` with PEFT, give A and B random (non-zero) values and save the adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, lora_dropout=0.0, **lora_config)
    model = get_peft_model(base, config)
    with torch.no_grad():  # B large enough that the adapter changes greedy choices
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def peft_model(model_dir: Path, adapter_dir: Path) -> Any:
    """The base model with the saved adapter, loaded by PEFT (the reference patchbay must match)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(
    model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], num_tokens: int
) -> list[list[int]]:
    """PEFT's own ``generate`` for each prompt alone, greedily, exactly ``num_tokens`` long (EOS does not stop it);
    ``adapter_dir`` ``None``: the base model through transformers."""
    from tiny_models import transformers_greedy

    if adapter_dir is None:
        return transformers_greedy(model_dir, prompts, num_tokens)
    model = peft_model(model_dir, adapter_dir)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        return [
            model.generate(
                input_ids=torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=num_tokens,
                do_sample=False,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
