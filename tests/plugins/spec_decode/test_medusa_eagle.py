"""The ``medusa`` and ``eagle`` drafters and their training, on a tiny random Llama (no full training here).

The EAGLE drafter's paged cache is checked against the dense rollout the
training code measures acceptance with: the same drafts, step after step,
through prefill, rejected drafts, block boundaries and scratch blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from patchbay.contract.registry import Registry, default_registry
from patchbay.interfaces import CommonAttentionMetadata, DraftBatch, DrafterConfig, DrafterContext, DraftStep
from patchbay.plugins.spec_decode import heads as heads_module
from patchbay.plugins.spec_decode import train
from patchbay.plugins.spec_decode.eagle import EagleDrafter, EagleOptions
from patchbay.plugins.spec_decode.eagle3 import Eagle3Drafter, Eagle3Options
from patchbay.plugins.spec_decode.heads import (
    DrafterFileError,
    Eagle3DraftModel,
    EagleDraftModel,
    MedusaHeads,
    save_drafter,
    target_identity,
    target_parts,
)
from patchbay.plugins.spec_decode.medusa import MedusaDrafter, MedusaOptions
from patchbay.testing import DrafterSuite
from patchbay.testing import drafter as kit
from tiny_models import build_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    directory = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama-gqa4")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model.name_or_path)


@pytest.fixture(scope="module")
def corpus(tiny_model, tokenizer) -> train.Corpus:
    prompts = train.build_prompts(tokenizer, 8, seed=0, max_prompt_tokens=24)
    return train.generate_corpus(tiny_model, prompts, max_new_tokens=24, eos_token_ids=[], batch_size=8)


CPU_BACKENDS = ("reference", "torch_sdpa", "flex")


def context_for(model, backend: str = "reference", block_size: int = BLOCK_SIZE) -> DrafterContext:
    """What the runner would hand a drafter, with one of the built-in CPU attention backends."""
    registry = default_registry()
    backend_class = registry.resolve("attention", backend)
    builder_class = registry.resolve("attention_metadata_builder", backend_class.metadata_builder)
    return DrafterContext(
        model=model,
        attention_backend=backend_class(),
        metadata_builder=builder_class(block_size=block_size),
        block_size=block_size,
        num_blocks=NUM_BLOCKS,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


def drafter_config(model, num_speculative_tokens: int = 3, max_model_len: int = 256) -> DrafterConfig:
    return DrafterConfig(
        num_speculative_tokens=num_speculative_tokens, max_model_len=max_model_len, vocab_size=model.config.vocab_size
    )


def hidden_of(model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.base_model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]


def aux_of(model, token_ids: list[int], layers: tuple[int, ...]) -> list[torch.Tensor]:
    """The outputs of decoder ``layers`` at every position, captured as the runner does for EAGLE-3."""
    from patchbay.toolkit.hidden_states import AuxHiddenStates

    capture = AuxHiddenStates.of_transformers_model(model, layers)
    with torch.inference_mode():
        model.base_model(input_ids=torch.tensor([token_ids]))
    found = capture.latest()
    capture.remove()
    return found


@pytest.fixture(scope="module")
def patchbay_registry() -> Registry:
    """The installed plugins, with the built-in drafters added by hand when the install predates them."""
    registry = default_registry()
    if "medusa" in registry.names("drafter"):
        return registry
    import patchbay.plugins.spec_decode.hooks as spec_decode_hooks

    registry = Registry.from_entry_points()
    registry.add_plugin(spec_decode_hooks, name="spec_decode")
    return registry


class TestMedusaConformance(DrafterSuite):
    plugin_name = "medusa"
    run_end_to_end = False  # test_greedy_output_is_unchanged_with_trained_weights, marked slow


class TestEagleConformance(DrafterSuite):
    plugin_name = "eagle"
    run_end_to_end = False


class TestEagle3Conformance(DrafterSuite):
    plugin_name = "eagle3"
    run_end_to_end = False


@pytest.mark.slow
@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
@pytest.mark.parametrize("weights", ["untrained", "trained"])
def test_greedy_output_is_unchanged_on_the_bundled_model(patchbay_registry, method, weights):
    """Lossless end to end; ``trained`` uses what ``patchbay-train-drafter`` saved on this machine (else skips)."""
    reason = kit.end_to_end_unavailable_reason(patchbay_registry)
    if reason:
        pytest.skip(reason)
    options = {}
    if weights == "trained":
        from patchbay.toolkit.model_files import resolve_model_dir

        directory = heads_module.default_drafter_dir(Path(resolve_model_dir("default")).name, method)
        if not (directory / "config.json").is_file():
            pytest.skip(f"no trained {method} weights at {directory} (run `patchbay-train-drafter {method}`)")
        options = {"path": "auto"}
    kit.check_end_to_end(
        method,
        options,
        registry=patchbay_registry,
        settings={"scheduler__chunked_prefill": True, "scheduler__max_num_batched_tokens": 64},
    )


# -- medusa ----------------------------------------------------------------------------------------


def test_untrained_medusa_proposes_the_lm_head_choice_within_limits(tiny_model):
    drafter = MedusaDrafter(MedusaOptions(), config=drafter_config(tiny_model, max_model_len=40))
    drafter.load(context_for(tiny_model))
    hidden = torch.randn(3, tiny_model.config.hidden_size)
    batch = DraftBatch(
        req_ids=["a", "b", "c"],
        token_ids=[np.arange(10), np.arange(39), np.arange(12)],
        num_speculative_tokens=3,
        max_model_len=40,
        hidden_states=hidden,
        skip={2},
    )
    drafts = drafter.propose(batch).draft_token_ids
    assert [len(d) for d in drafts] == [3, 1, 0]  # "b" has room for one token, "c" is skipped
    # Identity blocks over the lm head: every head repeats the lm head's own choice.
    expected = tiny_model.lm_head(hidden).argmax(-1).tolist()
    assert drafts[0] == [expected[0]] * 3 and drafts[1] == [expected[1]]
    assert drafter.propose(DraftBatch([], [], 3, 40, hidden_states=hidden[:0])).draft_token_ids == []


def test_trained_medusa_heads_round_trip_through_a_directory(tiny_model, tmp_path):
    parts = target_parts(tiny_model)
    heads = MedusaHeads(parts.hidden_size, 4, num_layers=2)
    torch.manual_seed(1)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    save_drafter(
        tmp_path,
        {
            "kind": "medusa",
            "num_heads": 4,
            "num_layers": 2,
            "hidden_size": parts.hidden_size,
            "vocab_size": parts.vocab_size,
            "target": target_identity(tiny_model),
        },
        heads,
    )

    drafter = MedusaDrafter(MedusaOptions(path=str(tmp_path)), config=drafter_config(tiny_model, 4))
    drafter.load(context_for(tiny_model))
    for name, tensor in heads.state_dict().items():
        assert torch.equal(drafter.heads.state_dict()[name], tensor), name
    hidden = torch.randn(2, parts.hidden_size)
    drafts = drafter.propose(
        DraftBatch(["a", "b"], [np.arange(5), np.arange(7)], 4, 256, hidden_states=hidden)
    ).draft_token_ids
    with torch.no_grad():
        expected = torch.stack([tiny_model.lm_head(head(hidden)).argmax(-1) for head in heads.heads], 1)
    assert drafts == expected.tolist()


def test_medusa_weights_for_another_hidden_size_are_refused_naming_the_file(tiny_model, tmp_path):
    heads = MedusaHeads(32, 2)
    save_drafter(tmp_path, {"kind": "medusa", "num_heads": 2, "target": {"hidden_size": 32, "vocab_size": 7}}, heads)
    drafter = MedusaDrafter(MedusaOptions(path=str(tmp_path)), config=drafter_config(tiny_model))
    with pytest.raises(DrafterFileError, match=r"config\.json: target\.hidden_size is 32"):
        drafter.load(context_for(tiny_model))
    with pytest.raises(DrafterFileError, match="kind is 'medusa', expected 'eagle'"):
        EagleDrafter(EagleOptions(path=str(tmp_path)), config=drafter_config(tiny_model)).load(context_for(tiny_model))


def test_path_auto_finds_the_training_commands_default_directory(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path))
    drafter = MedusaDrafter(MedusaOptions(path="auto"), config=drafter_config(tiny_model))
    with pytest.raises(DrafterFileError, match="patchbay-train-drafter medusa"):
        drafter.load(context_for(tiny_model))
    parts = target_parts(tiny_model)
    directory = heads_module.default_drafter_dir(heads_module.model_id(tiny_model), "medusa")
    save_drafter(
        directory,
        {"kind": "medusa", "num_heads": 2, "target": target_identity(tiny_model)},
        MedusaHeads(parts.hidden_size, 2),
    )
    drafter.load(context_for(tiny_model))
    assert drafter.heads.num_heads == 2


# -- eagle: the paged drafter against the dense rollout --------------------------------------------


class PagedRequest:
    """One request's target-side state for building DraftSteps by hand: tokens, blocks, what ran."""

    def __init__(self, model, token_ids: list[int], blocks: list[int]) -> None:
        self.model = model
        self.token_ids = list(token_ids)
        self.blocks = blocks

    def slots(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(self.blocks)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE


def make_step(
    requests: list[PagedRequest],
    runs: list[tuple[int, list[int]]],
    num_rejected: list[int],
    aux_layers: tuple[int, ...] = (),
) -> DraftStep:
    """The DraftStep of a target step where request ``i`` ran ``runs[i] = (first_position, tokens)``."""
    token_rows, positions, hidden, slots, lens = [], [], [], [], []
    aux: list[list[torch.Tensor]] = [[] for _ in aux_layers]
    for request, (first, tokens) in zip(requests, runs, strict=True):
        # The target's hidden states for what actually ran (drafts included, rejected or not).
        full = hidden_of(request.model, request.token_ids[:first] + tokens)
        for layer_rows, layer_states in zip(
            aux, aux_of(request.model, request.token_ids[:first] + tokens, aux_layers), strict=True
        ):
            layer_rows.append(layer_states[first:])
        rows = np.arange(first, first + len(tokens))
        token_rows.extend(tokens)
        positions.extend(rows.tolist())
        hidden.append(full[first:])
        slots.extend(request.slots(rows).tolist())
        lens.append(len(tokens))
    query_start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    seq_lens = torch.tensor([first + len(tokens) for first, tokens in runs], dtype=torch.int32)
    width = max(len(r.blocks) for r in requests)
    table = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in requests], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(query_start),
        query_start_loc_cpu=torch.from_numpy(query_start),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=torch.tensor([first for first, _ in runs], dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_reqs=len(requests),
        num_actual_tokens=len(token_rows),
        max_query_len=max(lens),
        max_seq_len=int(seq_lens.max()),
        block_size=BLOCK_SIZE,
    )
    return DraftStep(
        token_ids=torch.tensor(token_rows),
        positions=torch.tensor(positions),
        hidden_states=torch.cat(hidden),
        query_start_loc=query_start,
        num_rejected=np.asarray(num_rejected, dtype=np.int32),
        attention_metadata=common,
        aux_hidden_states=[torch.cat(rows) for rows in aux] or None,
    )


def dense_drafts(model, draft_model: EagleDraftModel, token_ids: list[int], num_drafts: int) -> list[int]:
    """What :func:`train.eagle_rollout` drafts after the last token of ``token_ids``."""
    hidden = hidden_of(model, token_ids)[:-1]
    corpus = train.Corpus([torch.tensor(token_ids)], [hidden], [torch.zeros(len(hidden), dtype=torch.long)], [1])
    reads_aux = isinstance(draft_model, Eagle3DraftModel)
    if reads_aux:
        corpus = train.add_aux_hidden_states(model, corpus, draft_model.aux_layers)
    batch = train.eagle_batch(corpus, [0], num_drafts, aux=reads_aux)
    with torch.no_grad():
        outputs, _ = train.eagle_rollout(draft_model, target_parts(model), batch, num_drafts, teacher_tokens=False)
    return [int(model.lm_head(output[0, len(token_ids) - 2]).argmax()) for output in outputs]


@pytest.mark.parametrize(
    ("kind", "backend"),
    [("eagle", backend) for backend in CPU_BACKENDS] + [("eagle3", "reference"), ("eagle3", "torch_sdpa")],
)
def test_paged_eagle_drafts_equal_the_dense_rollout_across_steps(tiny_model, tokenizer, kind, backend):
    """EAGLE-3 (layers 0, 3 and 1) drafts from the aux states on the first pass, then from its own outputs."""
    config = drafter_config(tiny_model, num_speculative_tokens=4)
    drafter = (
        EagleDrafter(EagleOptions(seed=3), config=config)
        if kind == "eagle"
        else Eagle3Drafter(Eagle3Options(seed=3, aux_layers=[0, -1, 1]), config=config)
    )
    drafter.load(context_for(tiny_model, backend))
    aux_layers = drafter.aux_hidden_state_layers()
    assert aux_layers == (() if kind == "eagle" else (0, 3, 1))
    with torch.no_grad():  # make attention decide the drafts, so a wrong key anywhere changes them
        layer = drafter.draft_model.layer
        for projection in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            projection.weight *= 4
    drafter.kv_cache = drafter._allocate_cache(1)  # one scratch block: growing them is part of the test
    prompt_a = tokenizer.encode("The quick brown fox jumps over the lazy dog because")[:10]
    prompt_b = tokenizer.encode("def add(a, b):\n    return a")[:8]
    # Greedy continuations of the target: the tokens verification would produce.
    with torch.inference_mode():
        continuation = {
            key: tiny_model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0].tolist()
            for key, p in (("a", prompt_a), ("b", prompt_b))
        }
    a = PagedRequest(tiny_model, continuation["a"][: len(prompt_a) + 1], [9, 3, 17, 5, 30, 11])
    b = PagedRequest(tiny_model, continuation["b"][: len(prompt_b) + 1], [2, 40, 7, 21, 8, 12])
    c = PagedRequest(tiny_model, prompt_b[:5], [44, 45, 46])  # a 5-token prompt, prefilled in chunks

    # Step 1: prefills of a and b (each sampled its first token), the first chunk of c.  Both drafts
    # run past the blocks the step covered (a: positions 10-12 of blocks for 0-11; b: 8-10 of 0-7).
    step = make_step([a, b, c], [(0, prompt_a), (0, prompt_b), (0, prompt_b[:3])], [0, 0, 0], aux_layers)
    batch = DraftBatch(["a", "b", "c"], [np.array(r.token_ids) for r in (a, b, c)], 4, 256, step=step, skip={2})
    drafts = drafter.propose(batch).draft_token_ids
    assert drafter.num_scratch_blocks >= 2
    assert drafts[0] == dense_drafts(tiny_model, drafter.draft_model, a.token_ids, 4)
    assert drafts[1] == dense_drafts(tiny_model, drafter.draft_model, b.token_ids, 4)
    assert drafts[2] == []

    # Step 2: a verifies [x, t1, t2, bad]: two accepted, one rejected; b verifies its (wrong) drafts, all rejected.
    full_a = continuation["a"]
    n = len(a.token_ids) - 1
    bad = (full_a[n + 3] + 1) % tiny_model.config.vocab_size
    run_a = (n, [full_a[n], full_a[n + 1], full_a[n + 2], bad])
    m = len(b.token_ids) - 1
    wrong = [(t + 7) % tiny_model.config.vocab_size for t in drafts[1]]
    run_b = (m, [b.token_ids[m], *wrong])
    step = make_step([a, b], [run_a, run_b], [1, 4], aux_layers)
    a.token_ids = full_a[: n + 4]  # gained t1, t2 and the recovered t3
    b.token_ids = continuation["b"][: m + 2]  # gained only the recovered token
    batch = DraftBatch(["a", "b"], [np.array(a.token_ids), np.array(b.token_ids)], 4, 256, step=step)
    drafts = drafter.propose(batch).draft_token_ids
    assert drafts[0] == dense_drafts(tiny_model, drafter.draft_model, a.token_ids, 4)
    assert drafts[1] == dense_drafts(tiny_model, drafter.draft_model, b.token_ids, 4)


def test_eagle_respects_max_model_len_skip_and_empty_batches(tiny_model, tokenizer):
    drafter = EagleDrafter(EagleOptions(), config=drafter_config(tiny_model, max_model_len=12))
    drafter.load(context_for(tiny_model))
    prompt = tokenizer.encode("One two three four five six seven eight nine ten")[:10]
    request = PagedRequest(tiny_model, prompt + [5], [4, 8, 12])
    other = PagedRequest(tiny_model, prompt[:6] + [5], [20, 21])
    step = make_step([request, other], [(0, prompt), (0, prompt[:6])], [0, 0])
    batch = DraftBatch(["a", "b"], [np.array(request.token_ids), np.array(other.token_ids)], 3, 12, step=step, skip={1})
    drafts = drafter.propose(batch).draft_token_ids
    assert len(drafts[0]) == 1 and drafts[1] == []  # 11 tokens, max_model_len 12: room for one
    assert all(0 <= t < tiny_model.config.vocab_size for t in drafts[0])
    assert drafter.propose(DraftBatch([], [], 3, 12)).draft_token_ids == []


def test_trained_eagle_layer_round_trips_through_a_directory_with_its_draft_vocabulary(tiny_model, tokenizer, tmp_path):
    parts = target_parts(tiny_model)
    torch.manual_seed(5)
    draft_model = EagleDraftModel.for_target(parts, intermediate_size=96, draft_vocab_size=300)
    draft_model.token_map.copy_(torch.arange(0, 3000, 10))
    save_drafter(tmp_path, {"kind": "eagle", **draft_model.sizes(), "target": target_identity(tiny_model)}, draft_model)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["intermediate_size"], config["draft_vocab_size"]) == (96, 300)
    drafter = EagleDrafter(EagleOptions(path=str(tmp_path)), config=drafter_config(tiny_model))
    drafter.load(context_for(tiny_model))
    for name, tensor in draft_model.state_dict().items():
        assert torch.equal(drafter.draft_model.state_dict()[name], tensor), name
    prompt = tokenizer.encode("A draft vocabulary of every tenth token")
    request = PagedRequest(tiny_model, prompt + [7], list(range(1, 8)))
    step = make_step([request], [(0, prompt)], [0])
    drafts = drafter.propose(DraftBatch(["a"], [np.array(request.token_ids)], 3, 256, step=step)).draft_token_ids
    assert len(drafts[0]) == 3 and all(t % 10 == 0 and t < 3000 for t in drafts[0])


def test_the_draft_vocabulary_maps_between_target_ids_and_its_rows(tiny_model):
    vocab = heads_module.DraftVocab(tiny_model.lm_head, torch.tensor([3, 7, 9]))
    assert vocab.indices_of(torch.tensor([7, 4, -100, 3])).tolist() == [1, -100, -100, 0]
    hidden = tiny_model.lm_head.weight[[9, 3]] * 10  # each row points at its own token
    assert vocab.argmax(hidden).tolist() == [9, 3]
    assert vocab.logits(hidden).shape == (2, 3)
    limited = heads_module.DraftVocab(tiny_model.lm_head, limit=100)
    assert limited.size == 100 and limited.indices_of(torch.tensor([99, 100])).tolist() == [99, -100]


def test_the_draft_token_map_takes_the_most_emitted_tokens_then_the_lowest_ids():
    greedy = [torch.tensor([50, 50, 50, 40, 40, 60]), torch.tensor([60, 60, 60, 60])]
    corpus = train.Corpus([torch.zeros(7), torch.zeros(5)], [torch.zeros(6, 2), torch.zeros(4, 2)], greedy, [1, 1])
    assert train.draft_token_map(corpus, 2, 100).tolist() == [50, 60]
    assert train.draft_token_map(corpus, 5, 100).tolist() == [0, 1, 40, 50, 60]
    assert train.draft_token_map(corpus, 0, 100) is None and train.draft_token_map(corpus, 100, 100) is None


# -- training --------------------------------------------------------------------------------------


def test_the_corpus_records_the_targets_greedy_generation(tiny_model, corpus):
    for token_ids, hidden, greedy, prompt_len in zip(
        corpus.token_ids, corpus.hidden, corpus.next_token_ids, corpus.prompt_lens, strict=True
    ):
        assert hidden.shape == (len(token_ids) - 1, tiny_model.config.hidden_size)
        torch.testing.assert_close(hidden, hidden_of(tiny_model, token_ids.tolist())[:-1], atol=1e-4, rtol=1e-4)
        assert torch.equal(greedy[prompt_len - 1 :], token_ids[prompt_len:])


def test_a_few_training_steps_lower_both_losses(tiny_model, corpus):
    parts = target_parts(tiny_model)
    train_set, held_out = corpus.split(0.25)

    heads = MedusaHeads(parts.hidden_size, 2)
    features, labels = train.medusa_examples(train_set, 2)
    vocab = heads.vocab(tiny_model.lm_head)

    def medusa_loss() -> float:
        with torch.no_grad():
            return float(train.medusa_loss(heads, vocab, features, vocab.indices_of(labels)))

    before = medusa_loss()
    train.train_medusa(heads, parts, train_set, held_out, seconds=float("inf"), max_steps=30, lr=1e-2, batch_size=32)
    assert medusa_loss() < 0.9 * before

    torch.manual_seed(0)
    draft_model = EagleDraftModel.for_target(parts)
    batch = train.eagle_batch(train_set, list(range(len(train_set))), 2)
    assert_eagle_training_lowers_loss(draft_model, parts, batch, train_set, held_out)


def assert_eagle_training_lowers_loss(draft_model, parts, batch, train_set, held_out) -> None:
    """30 steps of ``train_eagle`` cut the two-step loss on ``batch`` by 10 % and report held-out points."""

    def eagle_loss() -> float:
        with torch.no_grad():
            return float(
                train.eagle_loss(
                    draft_model,
                    parts,
                    batch,
                    2,
                    feature_noise=0.0,
                    token_weight=0.5,
                    token_rows=10**6,
                    generator=torch.Generator().manual_seed(0),
                )
            )

    before = eagle_loss()
    report = train.train_eagle(
        draft_model,
        parts,
        train_set,
        held_out,
        seconds=float("inf"),
        max_steps=30,
        num_steps=2,
        lr=1e-2,
        batch_size=2,
        token_rows=32,
    )
    assert eagle_loss() < 0.9 * before
    assert report.after.num_points > 0


def test_a_few_training_steps_lower_the_eagle3_loss(tiny_model, corpus):
    parts = target_parts(tiny_model)
    with_aux = train.add_aux_hidden_states(tiny_model, corpus, [0, 2, 3], batch_size=3)
    train_set, held_out = with_aux.split(0.25)
    torch.manual_seed(0)
    draft_model = Eagle3DraftModel.for_target(parts, aux_layers=[0, 2, 3])
    batch = train.eagle_batch(train_set, list(range(len(train_set))), 2, aux=True)
    assert batch.target_inputs.shape[-1] == 3 * parts.hidden_size
    assert_eagle_training_lowers_loss(draft_model, parts, batch, train_set, held_out)


def pattern_corpus(model, num_sequences: int, length: int = 40) -> train.Corpus:
    """Sequences cycling through 5 tokens from a random phase, with the pattern as the target's next tokens."""
    lm_head = model.lm_head.weight
    # Tokens the (random) lm head can make its argmax at all: its own direction must win.
    reachable = [t for t in range(1000, 1200) if int((lm_head @ lm_head[t]).argmax()) == t]
    pattern = torch.tensor(reachable[:5])
    generator = torch.Generator().manual_seed(0)
    token_ids, hidden = [], []
    for _ in range(num_sequences):
        tokens = pattern[(torch.arange(length) + int(torch.randint(5, (1,), generator=generator))) % 5]
        token_ids.append(tokens)
        hidden.append(hidden_of(model, tokens.tolist())[:-1].clone())
    return train.Corpus(token_ids, hidden, [t[1:].clone() for t in token_ids], [1] * num_sequences)


def test_medusa_heads_learn_a_deterministic_pattern(tiny_model):
    parts = target_parts(tiny_model)
    train_set, held_out = pattern_corpus(tiny_model, 12).split(0.25)
    heads = MedusaHeads(parts.hidden_size, 3, draft_vocab_size=2048)  # ids 0-2047: a twentieth of the work
    heads.token_map.copy_(torch.arange(2048))
    report = train.train_medusa(
        heads, parts, train_set, held_out, seconds=float("inf"), max_steps=120, lr=1e-2, batch_size=64
    )
    assert report.before.mean_accepted < 0.5
    assert min(report.after.accepted_rate) > 0.85
    assert report.after.mean_accepted_length > 3.5


def test_acceptance_counts_only_leading_correct_drafts():
    correct = torch.tensor([[True, True, False], [True, False, True], [False, True, True], [True, True, True]])
    acceptance = train.Acceptance.from_correct(correct)
    assert acceptance.correct_rate == [0.75, 0.75, 0.75]
    assert acceptance.accepted_rate == [0.75, 0.5, 0.25]
    assert acceptance.mean_accepted == pytest.approx((2 + 1 + 0 + 3) / 4)
    assert acceptance.conditional_rate == pytest.approx([0.75, 2 / 3, 0.5])


def test_the_training_command_writes_weights_the_drafters_load(tiny_model, tmp_path, capsys):
    from patchbay.plugins.spec_decode.train_cli import main

    model_dir = tiny_model.name_or_path
    drafters = {
        "medusa": (MedusaDrafter, MedusaOptions),
        "eagle": (EagleDrafter, EagleOptions),
        "eagle3": (Eagle3Drafter, Eagle3Options),
    }
    for kind, (drafter_class, options) in drafters.items():
        out = tmp_path / kind
        status = main(
            [
                kind,
                "--model",
                model_dir,
                "--out",
                str(out),
                "--sequences",
                "6",
                "--max-new-tokens",
                "12",
                "--max-steps",
                "2",
                "--corpus",
                str(tmp_path / "corpus.pt"),
                "--batch-size",
                "2",
                "--draft-vocab",
                "512",
            ]
        )
        assert status == 0
        printed = capsys.readouterr().out
        assert "mean accepted length" in printed and str(out) in printed
        config = json.loads((out / "config.json").read_text())
        assert config["training"]["acceptance"]["num_points"] > 0 and config["draft_vocab_size"] == 512
        drafter = drafter_class(options(path=str(out)), config=drafter_config(tiny_model))
        drafter.load(context_for(tiny_model))
        if kind == "eagle3":  # the layers it was trained on: the default low, middle and high of the 4
            assert config["aux_layers"] == [2, 2, 1] and drafter.aux_hidden_state_layers() == (2, 2, 1)
