"""Engine messages that blame the right plugin (issue 29 item 2, issue 30's "``patchbay run`` prints None"):
a token outside the grammar's mask is the sampler's fault when the applied row masked it, the matcher's
when its own bitmask allowed it; compile and grammar failures set ``error`` on the output, and
``patchbay run`` prints that message as the first failure's error."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
import yaml

import patchbay
from patchbay import hookimpl
from patchbay.contract.registry import Registry, default_registry
from patchbay.entrypoints import cli
from patchbay.interfaces import GrammarMatcher, Sampler, StructuredOutputBackend, StructuredOutputParams
from patchbay.interfaces.sampler import SamplerCapabilities, SamplerOutput
from patchbay.scheduling.structured_output import GrammarCompilations
from patchbay.testing.structured_output import bundled_tokenizer
from patchbay.worker.structured_output import ConstrainedDecoding


@pytest.fixture(scope="module")
def xgrammar() -> GrammarCompilations:
    tokenizer = bundled_tokenizer()
    backend_class = default_registry().resolve("structured_output", "xgrammar")
    return GrammarCompilations(
        lambda: backend_class(tokenizer=tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]),
        "xgrammar",
    )


def test_a_masked_token_the_sampler_returned_blames_the_sampler(xgrammar):
    """The engine blamed the grammar backend for a token the sampler drew from a -inf (masked) logit."""
    params = StructuredOutputParams(regex="[0-9]+")
    grammar = xgrammar.submit(params).result(timeout=60)
    constrained = ConstrainedDecoding(xgrammar, "sampler:broken")
    constrained.add("r", grammar, [], params.field_path)
    logits = torch.zeros(1, xgrammar.backend.vocab_size)
    constrained.mask(logits, ["r"], [], np.array([0]))
    letter = bundled_tokenizer().encode("x")[0]
    assert logits[0, letter] == float("-inf")
    constrained.advance(["r"], [[letter]])
    message = constrained.take_failed()["r"]
    assert message.startswith(f"sampler:broken returned token {letter}, which the grammar's bitmask masked")
    assert "structured_output.regex" in message and "'xgrammar'" in message


class _RefusingMatcher(GrammarMatcher):
    """Allows every token in its bitmask, then refuses them all: the backend is at fault."""

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        return 0

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = -1

    def is_accepting(self) -> bool:
        return False

    def is_terminated(self) -> bool:
        return False


class _RefusingBackend(StructuredOutputBackend):
    def compile(self, params: StructuredOutputParams) -> Any:
        return params.spec

    def matcher(self, grammar: Any) -> GrammarMatcher:
        return _RefusingMatcher()


def test_a_token_the_matcher_s_own_bitmask_allowed_blames_the_backend():
    grammars = GrammarCompilations(lambda: _RefusingBackend(tokenizer=None, vocab_size=64, stop_token_ids=[0]), "liar")
    params = StructuredOutputParams(regex="a")
    constrained = ConstrainedDecoding(grammars, "sampler:fine")
    constrained.add("r", grammars.submit(params).result(timeout=10), [], params.field_path)
    constrained.mask(torch.zeros(1, 64), ["r"], [], np.array([0]))
    constrained.advance(["r"], [[7]])
    assert constrained.take_failed()["r"] == (
        "structured_output backend 'liar' (structured_output.regex) rejected token 7, which its own bitmask allowed"
    )


class ArgminSampler(Sampler):
    """Picks the least likely token: under a grammar, a masked one (a sampler broken on purpose)."""

    capabilities = SamplerCapabilities(supported_params=frozenset(), supports_random=False)

    def sample(self, logits: torch.Tensor, metadata: Any) -> SamplerOutput:
        return SamplerOutput(sampled_token_ids=torch.argmin(logits, dim=-1, keepdim=True))


class ArgminPlugin:
    @hookimpl
    def register_samplers(self, register):
        register("argmin", ArgminSampler, description="the least likely token (broken on purpose)")


def test_outputs_carry_the_error_of_grammar_and_sampler_failures(tiny_llama):
    """``error`` was None on outputs failed for their grammar; the message was only in stop_reason."""
    registry = Registry.from_entry_points()
    registry.add_plugin(ArgminPlugin(), name="argmin-plugin")
    llm = patchbay.LLM(
        registry=registry,
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        runtime__threads=1,
        cache__num_blocks=32,
        model__max_model_len=64,
        sampler__name="argmin",
    )
    masked, uncompilable = llm.generate(
        [[5, 6, 7], [5, 6, 8]],
        [
            patchbay.SamplingParams(max_tokens=3, temperature=0, structured_output={"regex": "[0-9]+"}),
            patchbay.SamplingParams(max_tokens=3, temperature=0, structured_output={"grammar": "root ::= nothere"}),
        ],
    )
    assert masked.finish_reason == "error"
    assert masked.error is not None and masked.error.startswith("sampler:argmin returned token")
    assert uncompilable.finish_reason == "error"
    assert uncompilable.error is not None and "cannot compile structured_output.grammar" in uncompilable.error


def test_patchbay_run_prints_the_first_failure_s_real_message(tiny_llama, tmp_path, capsys):
    """``patchbay run`` printed ``None`` as the first failure's error for grammar compile failures."""
    lines = [
        {"id": "fine", "prompt_token_ids": [5, 6, 7]},
        {"id": "broken", "prompt_token_ids": [5, 6, 8], "structured_output": {"grammar": "root ::= nothere"}},
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = {
        "model": {"path": str(tiny_llama), "max_model_len": 64},
        "runtime": {"threads": 1},
        "cache": {"num_blocks": 64},
        "attention": {"name": "torch_sdpa"},
        "inputs": {"file": str(tmp_path / "requests.jsonl"), "sampling": {"max_tokens": 3}},
        "outputs": {"path": str(tmp_path / "out.jsonl"), "progress": False},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    code = cli.main(["run", str(tmp_path / "job.yaml")])
    err = capsys.readouterr().err
    assert code != 0
    first = next(line for line in err.splitlines() if "requests failed" in line)
    assert "the first: request 'broken': structured_output backend 'xgrammar' cannot compile" in first
    assert "None" not in first and 'Rule "nothere" is not defined' in first
    results = {json.loads(line)["id"]: json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()}
    assert "cannot compile" in results["broken"]["error"] and "error" not in results["fine"]
