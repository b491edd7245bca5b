"""EAGLE-3's plumbing: the runner captures the target layers a drafter names, during its own forward pass.

The captured outputs are checked against transformers' ``output_hidden_states``
of a plain forward over the same tokens; the drafter's side (paged drafts
equal the dense rollout, training, weight files) is in test_medusa_eagle.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch

import patchbay
from patchbay.interfaces import DraftBatch, DrafterCapabilities, DraftProposals
from patchbay.interfaces.drafter import resolve_aux_layers
from patchbay.plugins.spec_decode.eagle3 import Eagle3Drafter
from patchbay.plugins.spec_decode.ngram import NgramDrafter
from patchbay.sampling_params import SamplingParams
from patchbay.toolkit.hidden_states import AuxHiddenStates
from patchbay.worker.model.hf_model import HFCausalLM
from patchbay.worker.model_runner import ModelRunner

PROMPT = list(range(300, 337))


def assert_layer_outputs(
    model_dir: Path, token_ids: list[int], layers: tuple[int, ...], captured: list[torch.Tensor], first_row: int = 0
) -> None:
    """``captured[j]`` is layer ``layers[j]``'s output at rows ``first_row..`` of a plain transformers forward.

    That is ``output_hidden_states[i + 1]``, but for the last layer, whose entry there is after the final
    norm: the captured (pre-norm) output, normed, must equal it.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        states = model.model(input_ids=torch.tensor([token_ids]), output_hidden_states=True).hidden_states
        last = len(states) - 2
        for index, got in zip(layers, captured, strict=True):
            want = states[index + 1][0, first_row:]
            if index == last:
                got = model.model.norm(got)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, i=index: f"layer {i}: {m}")


def test_captured_layer_outputs_equal_transformers_hidden_states(tiny_llama):
    llm = patchbay.LLM(model__path=str(tiny_llama), runtime__threads=2)
    layers = (2, 0, 2, 1, 3)  # any order, repeats allowed, the last layer too
    capture = llm.engine.model.capture_hidden_states(layers)
    llm.generate([PROMPT], SamplingParams(max_tokens=1))  # one forward: the whole prompt
    captured = capture.latest()
    assert [tuple(t.shape) for t in captured] == [(len(PROMPT), 64)] * len(layers)
    assert_layer_outputs(tiny_llama, PROMPT, layers, captured)
    # Layers differ from each other, so a capture of the wrong layer cannot pass.
    assert not torch.allclose(captured[0], captured[1], atol=1e-2)
    capture.remove()
    llm.generate([PROMPT[:5]], SamplingParams(max_tokens=1))
    assert torch.equal(capture_of_nothing(capture), torch.zeros(0))


def capture_of_nothing(capture: AuxHiddenStates) -> torch.Tensor:
    with pytest.raises(RuntimeError, match="no forward pass"):
        capture.latest()
    return torch.zeros(0)


def test_the_runner_hands_eagle3_the_layers_of_every_row_it_ran(tiny_llama, monkeypatch):
    """Prefill and verification steps: each DraftStep row's aux states are the target's at that row's token."""
    seen: list[tuple[list[int], list[int], list[torch.Tensor]]] = []
    original = Eagle3Drafter.propose

    def spy(self: Eagle3Drafter, batch: DraftBatch) -> DraftProposals:
        step = batch.step
        assert step is not None and step.aux_hidden_states is not None
        seen.append((step.token_ids.tolist(), step.positions.tolist(), [t.clone() for t in step.aux_hidden_states]))
        return original(self, batch)

    monkeypatch.setattr(Eagle3Drafter, "propose", spy)
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        runtime__threads=2,
        spec_decode={"name": "eagle3", "num_speculative_tokens": 2, "options": {"aux_layers": [0, -1, 2]}},
    )
    output = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert llm.engine.runner.aux_hidden_states.layers == (0, 3, 2)
    full = PROMPT + output.token_ids
    assert len(seen) >= 2 and llm.spec_stats.num_draft_tokens > 0
    for token_ids, positions, aux in seen:
        # What the target ran: the known tokens before the step's first position, then the step's rows
        # (drafts included, accepted or not).
        assert_layer_outputs(tiny_llama, full[: positions[0]] + token_ids, (0, 3, 2), aux, positions[0])


class AsksForLayerNine(NgramDrafter):
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(needs_aux_hidden_states=(0, 9))


class AsksForTheLastTwo(NgramDrafter):
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(needs_aux_hidden_states=(-2, -1))


@pytest.fixture(scope="module")
def hf_model(tiny_llama) -> HFCausalLM:
    return HFCausalLM.load(tiny_llama, dtype="float32", device=torch.device("cpu"))


def test_layers_outside_the_model_stop_the_run_naming_the_drafter(hf_model):
    with pytest.raises(ValueError, match=r"drafter 'AsksForLayerNine' asks for .*\(0, 9\).*4 decoder layers.*\[9\]"):
        ModelRunner._aux_capture(hf_model, AsksForLayerNine())


def test_negative_layers_count_from_the_last_and_no_request_hooks_nothing(hf_model):
    layers = hf_model.model.model.layers
    capture = ModelRunner._aux_capture(hf_model, AsksForTheLastTwo())
    assert capture is not None and capture.layers == (2, 3)
    assert [len(layer._forward_hooks) for layer in layers] == [0, 0, 1, 1]
    capture.remove()
    assert ModelRunner._aux_capture(hf_model, NgramDrafter()) is None
    assert ModelRunner._aux_capture(hf_model, None) is None
    assert all(not layer._forward_hooks for layer in layers)


def test_eagle3_options_outside_the_model_fail_at_load_naming_it(tiny_llama):
    with pytest.raises(ValueError, match=r"drafter 'eagle3' asks for .*\(0, 4\)"):
        patchbay.LLM(model__path=str(tiny_llama), spec_decode={"name": "eagle3", "options": {"aux_layers": [0, 4]}})


def test_resolve_aux_layers_accepts_both_ends_exactly():
    assert resolve_aux_layers((0, 29, -30, -1), 30, drafter="d") == (0, 29, 0, 29)
    for bad in (30, -31):
        with pytest.raises(ValueError, match="drafter 'd'"):
            resolve_aux_layers((bad,), 30, drafter="d")
