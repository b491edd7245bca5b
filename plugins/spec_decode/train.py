"""Training Medusa heads and the EAGLE draft layer by self-distillation from the target model, on the CPU.

1. :func:`build_prompts` mixes chat prompts (topics x instructions) with
   snippets of patchbay's own source code;
2. :func:`generate_corpus` lets the target answer them (greedy by default),
   recording every position's final hidden state and the target's greedy
   next token: a :class:`Corpus`;
3. :func:`train_medusa` / :func:`train_eagle` fit the drafter (EAGLE-3 too,
   after :func:`add_aux_hidden_states` adds the layers it reads) for a fixed
   wall-clock budget, and :func:`medusa_acceptance` /
   :func:`eagle_acceptance` measure, on held-out sequences, how many
   drafts greedy verification would accept.

Index conventions (one sequence of ``L`` tokens ``t[0..L-1]``)::

    hidden[p]          p < L-1   the target's final hidden state at p (it produced token p+1)
    next_token_ids[p]  p < L-1   the target's greedy choice after p (= t[p+1] where the target generated)

A drafting point ``p`` is a moment when the request's last token is
``t[p+1]`` and ``hidden[p]`` produced it; draft ``i`` (from 0) guesses
token ``p + 2 + i``, whose greedy value is ``next_token_ids[p + 1 + i]``.
"""

from __future__ import annotations

import inspect
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from patchbay.plugins.spec_decode.heads import (
    DraftVocab,
    Eagle3DraftModel,
    EagleDraftModel,
    MedusaHeads,
    Rotary,
    TargetParts,
    repeat_kv,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Log = Callable[[str], None]

# -- prompts ---------------------------------------------------------------------------------------

TOPICS = (
    "photosynthesis",
    "black holes",
    "the French Revolution",
    "sourdough bread",
    "climate change",
    "volcanoes",
    "the immune system",
    "machine learning",
    "the Roman Empire",
    "electric cars",
    "honey bees",
    "chess openings",
    "the water cycle",
    "quantum computing",
    "jazz music",
    "the stock market",
    "sleep",
    "coral reefs",
    "the printing press",
    "vaccines",
    "renewable energy",
    "ancient Egypt",
    "the human brain",
    "coffee",
    "plate tectonics",
    "recycling",
    "the moon landing",
    "bicycles",
    "public libraries",
    "time management",
    "learning a new language",
    "the internet",
    "rainforests",
    "gravity",
    "the Olympic Games",
    "marathon training",
    "budgeting",
    "origami",
    "dinosaurs",
    "composting",
    "the solar system",
    "friendship",
    "job interviews",
    "writing a resume",
    "healthy breakfasts",
    "the history of mathematics",
    "penguins",
    "cloud computing",
)
CHAT_INSTRUCTIONS = (
    "Explain {topic} in simple terms.",
    "Write a short story about {topic}.",
    "Give me three interesting facts about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a haiku about {topic}.",
    "Summarise the history of {topic} in a paragraph.",
    "How would you teach a child about {topic}?",
    "Write a list of five questions about {topic}.",
    "Describe {topic} to someone who has never heard of it.",
    "What is the most common misconception about {topic}?",
)
CODE_INSTRUCTIONS = (
    "Explain what this Python code does:\n```python\n{code}\n```",
    "Add comments to this code:\n```python\n{code}\n```",
    "Is there a bug in this code?\n```python\n{code}\n```",
    "Rewrite this code to be shorter:\n```python\n{code}\n```",
)


def source_files() -> list[Path]:
    """patchbay's own Python sources (the core and the built-in plugins)."""
    import patchbay

    roots = {Path(patchbay.__file__).parent, Path(__file__).resolve().parents[1]}  # the core, then the plugins
    return sorted(path for root in roots for path in root.rglob("*.py"))


def code_snippets(count: int, rng: random.Random, lines: tuple[int, int] = (6, 16)) -> list[str]:
    """``count`` windows of consecutive, not-all-blank lines from :func:`source_files`."""
    texts = [path.read_text().splitlines() for path in source_files()]
    texts = [text for text in texts if len(text) > lines[1]]
    snippets: list[str] = []
    while len(snippets) < count:
        text = rng.choice(texts)
        length = rng.randint(*lines)
        start = rng.randrange(len(text) - length)
        snippet = "\n".join(text[start : start + length]).strip("\n")
        if len(snippet.strip()) > 40:
            snippets.append(snippet)
    return snippets


def build_prompts(
    tokenizer: Any, count: int, seed: int = 0, code_fraction: float = 0.35, max_prompt_tokens: int = 256
) -> list[list[int]]:
    """``count`` prompt token lists: chat questions on built-in topics, and patchbay source code.

    Code comes as a chat question about a snippet, or (one in four) as raw
    code to continue, without the chat template.
    """
    rng = random.Random(seed)
    num_code = round(count * code_fraction)
    snippets = code_snippets(num_code, rng)
    prompts = []
    for index in range(count):
        if index < num_code:
            code = snippets[index]
            if index % 4 == 3:
                prompts.append(tokenizer.encode(code + "\n", add_special_tokens=False)[-max_prompt_tokens:])
                continue
            text = rng.choice(CODE_INSTRUCTIONS).format(code=code)
        else:
            text = rng.choice(CHAT_INSTRUCTIONS).format(topic=rng.choice(TOPICS))
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer.encode(chat, add_special_tokens=False)[-max_prompt_tokens:])
    rng.shuffle(prompts)
    return prompts


# -- the corpus ------------------------------------------------------------------------------------


@dataclass
class Corpus:
    """The target's own generations with what it computed along the way (see the module docstring)."""

    token_ids: list[torch.Tensor]
    """int64 ``[L]`` per sequence: prompt, then generated tokens."""
    hidden: list[torch.Tensor]
    """float32 ``[L-1, hidden]``."""
    next_token_ids: list[torch.Tensor]
    """int64 ``[L-1]``: the target's greedy next token after each position."""
    prompt_lens: list[int]
    info: dict[str, Any] = field(default_factory=dict)
    aux: list[torch.Tensor] | None = None
    """float32 ``[L-1, len(info["aux_layers"]) * hidden]`` per sequence: the outputs of the layers EAGLE-3 reads,
    concatenated (see :func:`add_aux_hidden_states`); ``None`` when not computed."""

    def __len__(self) -> int:
        return len(self.token_ids)

    def subset(self, indices: Sequence[int]) -> Corpus:
        return Corpus(
            [self.token_ids[i] for i in indices],
            [self.hidden[i] for i in indices],
            [self.next_token_ids[i] for i in indices],
            [self.prompt_lens[i] for i in indices],
            self.info,
            None if self.aux is None else [self.aux[i] for i in indices],
        )

    def split(self, eval_fraction: float) -> tuple[Corpus, Corpus]:
        """(train, held-out): the last ``eval_fraction`` of the sequences are held out (at least one)."""
        num_eval = max(1, round(len(self) * eval_fraction)) if len(self) > 1 else 0
        cut = len(self) - num_eval
        return self.subset(range(cut)), self.subset(range(cut, len(self)))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(".partial")
        torch.save(asdict(self), staging)
        staging.rename(path)

    @classmethod
    def load(cls, path: Path) -> Corpus:
        return cls(**torch.load(path, weights_only=True))


@torch.inference_mode()
def generate_corpus(
    model: PreTrainedModel,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    batch_size: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    log: Log | None = None,
) -> Corpus:
    """Let the transformers ``model`` continue every prompt, recording hidden states and greedy choices.

    Prompts run in batches of similar length, left-padded; a sequence ends
    after its first end-of-sequence token or ``max_new_tokens`` tokens.
    """
    decoder, lm_head = model.base_model, model.get_output_embeddings()
    generator = torch.Generator().manual_seed(seed)
    eos = torch.tensor(sorted(set(eos_token_ids)) or [-1])
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    started = time.perf_counter()
    for batch_start in range(0, len(order), batch_size):
        indices = order[batch_start : batch_start + batch_size]
        batch = [prompts[i] for i in indices]
        width = max(len(p) for p in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        output = _decode(decoder, input_ids, mask, positions, None)
        cache = _cache_of(output)
        hidden_steps = [output.last_hidden_state.float()]
        greedy_steps = [_argmax_chunked(lm_head, output.last_hidden_state)]
        tokens = [_choose(lm_head(output.last_hidden_state[:, -1]).float(), temperature, generator)]
        done = torch.isin(tokens[-1], eos)
        last_position = positions[:, -1]
        for _ in range(max_new_tokens - 1):
            if bool(done.all()):
                break
            mask = torch.cat((mask, torch.ones((len(batch), 1), dtype=torch.long)), dim=1)
            last_position = last_position + 1
            output = _decode(decoder, tokens[-1][:, None], mask, last_position[:, None], cache)
            cache = _cache_of(output)
            hidden = output.last_hidden_state
            hidden_steps.append(hidden.float())
            logits = lm_head(hidden[:, -1]).float()
            greedy_steps.append(logits.argmax(dim=-1)[:, None])
            tokens.append(_choose(logits, temperature, generator))
            done |= torch.isin(tokens[-1], eos)
        all_hidden = torch.cat(hidden_steps, dim=1)
        all_greedy = torch.cat(greedy_steps, dim=1)
        generated = torch.stack(tokens, dim=1)
        for row, index in enumerate(indices):
            results[index] = _trim(prompts[index], width, generated[row], all_hidden[row], all_greedy[row], eos)
        if log is not None:
            done_count = min(batch_start + batch_size, len(order))
            log(f"generated {done_count}/{len(order)} sequences ({time.perf_counter() - started:.0f} s)")
    token_ids, hidden, greedy = zip(*(results[i] for i in range(len(prompts))), strict=True)
    return Corpus(
        list(token_ids),
        list(hidden),
        list(greedy),
        [len(p) for p in prompts],
        info={"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed},
    )


def _decode(
    decoder: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
) -> Any:
    """One forward of the transformers decoder with a KV cache.

    The cache goes in as ``cache=`` in transformers 5, else as ``past_key_values=``.
    """
    name = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    return decoder(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **{name: cache})


def _cache_of(output: Any) -> Any:
    found = getattr(output, "cache", None)
    return found if found is not None else output.past_key_values


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]


def _argmax_chunked(lm_head: nn.Linear, hidden: torch.Tensor, rows: int = 512) -> torch.Tensor:
    """``argmax(lm_head(hidden))`` over the last dimension, a few hundred rows at a time (logits are wide)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    found = torch.cat([lm_head(flat[i : i + rows]).argmax(dim=-1) for i in range(0, len(flat), rows)])
    return found.reshape(hidden.shape[:-1])


def _trim(
    prompt: list[int],
    width: int,
    generated: torch.Tensor,
    hidden: torch.Tensor,
    greedy: torch.Tensor,
    eos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence of a left-padded batch: tokens up to the first end-of-sequence, hidden and greedy per position."""
    stops = torch.isin(generated, eos).nonzero()
    num_generated = int(stops[0, 0]) + 1 if len(stops) else len(generated)
    token_ids = torch.cat((torch.tensor(prompt, dtype=torch.long), generated[:num_generated]))
    pad = width - len(prompt)
    length = len(token_ids) - 1
    return token_ids, hidden[pad : pad + length].clone(), greedy[pad : pad + length].clone()


@torch.inference_mode()
def add_aux_hidden_states(
    model: PreTrainedModel, corpus: Corpus, layers: Sequence[int], *, batch_size: int = 8, log: Log | None = None
) -> Corpus:
    """``corpus`` with :attr:`Corpus.aux`: the outputs of decoder ``layers`` of ``model`` at every position.

    One teacher-forced pass over each sequence's tokens (right-padded
    batches; causal attention keeps padding out of the real rows), with the
    runner's own hooks (:class:`~patchbay.toolkit.hidden_states.AuxHiddenStates`), so
    training reads what inference will.
    """
    from patchbay.toolkit.hidden_states import AuxHiddenStates

    decoder = model.base_model
    capture = AuxHiddenStates.of_transformers_model(model, layers)
    aux: list[torch.Tensor] = []
    started = time.perf_counter()
    for start in range(0, len(corpus), batch_size):
        sequences = corpus.token_ids[start : start + batch_size]
        width = max(len(tokens) for tokens in sequences)
        input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, tokens in enumerate(sequences):
            input_ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        decoder(input_ids=input_ids, attention_mask=mask)
        chosen = torch.cat(capture.latest_batched(), dim=-1).float()
        aux.extend(chosen[row, : len(tokens) - 1].clone() for row, tokens in enumerate(sequences))
        if log is not None:
            log(
                f"aux hidden states of layers {tuple(layers)}: {min(start + batch_size, len(corpus))}/{len(corpus)} "
                f"sequences ({time.perf_counter() - started:.0f} s)"
            )
    capture.remove()
    return Corpus(
        corpus.token_ids,
        corpus.hidden,
        corpus.next_token_ids,
        corpus.prompt_lens,
        {**corpus.info, "aux_layers": list(layers)},
        aux,
    )


def draft_token_map(corpus: Corpus, size: int, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary: the ``size`` tokens the target emits most in ``corpus``, ascending ids.

    When the corpus holds fewer distinct tokens, the lowest unseen ids fill
    the rest (byte-pair vocabularies number their most frequent merges
    first).  ``None`` (the whole vocabulary) when ``size`` is 0 or covers it.
    """
    if not size or size >= vocab_size:
        return None
    counts = torch.bincount(torch.cat(corpus.next_token_ids), minlength=vocab_size)[:vocab_size].float()
    # Seen tokens by count, then unseen ones by id: a tiny id-ordered tie-break does both.
    order = torch.argsort(counts - torch.arange(vocab_size) / vocab_size, descending=True)
    return order[:size].sort().values


# -- acceptance ------------------------------------------------------------------------------------


@dataclass
class Acceptance:
    """How greedy verification would treat a drafter's chains on held-out drafting points."""

    correct_rate: list[float]
    """Per draft position ``i``: fraction of drafts equal to the target's token ``i + 1`` places ahead."""
    accepted_rate: list[float]
    """Per draft position ``i``: fraction of chains whose drafts ``0..i`` are all accepted."""
    mean_accepted: float
    """Mean accepted drafts per verification step (0..K)."""
    num_points: int

    @property
    def conditional_rate(self) -> list[float]:
        """Per position: acceptance given every earlier draft was accepted."""
        previous = [1.0, *self.accepted_rate[:-1]]
        return [a / b if b else 0.0 for a, b in zip(self.accepted_rate, previous, strict=True)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per target step: accepted drafts plus the recovered or bonus token."""
        return 1.0 + self.mean_accepted

    @classmethod
    def from_correct(cls, correct: torch.Tensor) -> Acceptance:
        """From a bool ``[points, K]`` matrix of draft-equals-target."""
        if correct.numel() == 0:
            return cls([0.0] * correct.shape[-1], [0.0] * correct.shape[-1], 0.0, 0)
        accepted = correct.long().cumprod(dim=1)
        return cls(
            correct.float().mean(0).tolist(),
            accepted.float().mean(0).tolist(),
            float(accepted.sum(1).float().mean()),
            correct.shape[0],
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "correct_rate": [round(x, 4) for x in self.correct_rate],
            "accepted_rate": [round(x, 4) for x in self.accepted_rate],
            "conditional_rate": [round(x, 4) for x in self.conditional_rate],
            "mean_accepted": round(self.mean_accepted, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "num_points": self.num_points,
        }

    def describe(self) -> str:
        positions = "  ".join(
            f"#{i + 1}: {c:.3f} (chain {a:.3f}, given previous {g:.3f})"
            for i, (c, a, g) in enumerate(
                zip(self.correct_rate, self.accepted_rate, self.conditional_rate, strict=True)
            )
        )
        return (
            f"acceptance per draft position  {positions}\n"
            f"mean accepted drafts per step {self.mean_accepted:.3f}, "
            f"mean accepted length {self.mean_accepted_length:.3f} tokens per target step "
            f"({self.num_points} held-out drafting points)"
        )


def drafting_points(corpus: Corpus, index: int, num_drafts: int) -> range:
    """Drafting points ``p`` of sequence ``index`` inside the generated part whose ``num_drafts`` targets exist."""
    length = len(corpus.token_ids[index])
    first = max(corpus.prompt_lens[index] - 1, 0)
    return range(first, length - 1 - num_drafts)


def chain_targets(corpus: Corpus, index: int, points: range, num_drafts: int) -> torch.Tensor:
    """``[len(points), num_drafts]``: the target's greedy token for each draft of each point."""
    greedy = corpus.next_token_ids[index]
    offsets = torch.arange(num_drafts)
    return greedy[torch.tensor(list(points), dtype=torch.long)[:, None] + 1 + offsets]


# -- Medusa ----------------------------------------------------------------------------------------


def medusa_examples(corpus: Corpus, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(features ``[N, hidden]``, labels ``[N, num_heads]``) over every drafting point; missing labels are -100."""
    features, labels = [], []
    for index in range(len(corpus)):
        length = len(corpus.token_ids[index])
        points = range(max(corpus.prompt_lens[index] - 1, 0), length - 2)
        if not len(points):
            continue
        greedy = torch.cat((corpus.next_token_ids[index], torch.full((num_heads + 1,), -100)))
        where = torch.tensor(list(points), dtype=torch.long)
        features.append(corpus.hidden[index][where])
        labels.append(greedy[where[:, None] + 1 + torch.arange(num_heads)])
    if not features:
        raise ValueError("the corpus has no drafting points (every sequence is a prompt without generated tokens)")
    return torch.cat(features), torch.cat(labels)


def medusa_loss(
    heads: MedusaHeads, vocab: DraftVocab, features: torch.Tensor, labels: torch.Tensor, decay: float = 0.8
) -> torch.Tensor:
    """Cross-entropy of each head against its labels, head ``i`` weighted ``decay ** i`` (as in Medusa).

    ``labels`` are draft-vocabulary indices (:meth:`DraftVocab.indices_of`); -100 is ignored.
    """
    total = features.new_zeros(())
    for i, logits in enumerate(heads.logits(features, vocab)):
        if bool((labels[:, i] >= 0).any()):
            total = total + decay**i * F.cross_entropy(logits.float(), labels[:, i], ignore_index=-100)
    return total


@torch.no_grad()
def medusa_acceptance(
    heads: MedusaHeads, vocab: DraftVocab, corpus: Corpus, num_drafts: int | None = None, rows: int = 256
) -> Acceptance:
    """Greedy acceptance of the heads' chains at every held-out drafting point."""
    num_drafts = num_drafts or heads.num_heads
    correct = []
    for index in range(len(corpus)):
        points = drafting_points(corpus, index, num_drafts)
        if not len(points):
            continue
        targets = chain_targets(corpus, index, points, num_drafts)
        features = corpus.hidden[index][points.start : points.stop]
        for start in range(0, len(points), rows):
            chunk = features[start : start + rows]
            drafts = torch.stack([vocab.argmax(head(chunk)) for head in heads.heads[:num_drafts]], dim=1)
            correct.append(drafts == targets[start : start + rows])
    return Acceptance.from_correct(torch.cat(correct) if correct else torch.zeros((0, num_drafts), dtype=torch.bool))


@dataclass
class TrainReport:
    """What a training run did and reached."""

    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    before: Acceptance
    after: Acceptance

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "seconds": round(self.seconds, 1),
            "first_loss": round(self.first_loss, 4),
            "last_loss": round(self.last_loss, 4),
            "acceptance_before": self.before.as_dict(),
            "acceptance": self.after.as_dict(),
        }


def train_medusa(
    heads: MedusaHeads,
    parts: TargetParts,
    train: Corpus,
    held_out: Corpus,
    *,
    seconds: float,
    lr: float = 1e-3,
    batch_size: int = 128,
    max_steps: int | None = None,
    seed: int = 0,
    log: Log | None = None,
) -> TrainReport:
    """Fit the heads' residual blocks (the lm head stays frozen) for ``seconds`` of wall clock (or ``max_steps``).

    The heads' ``token_map`` (if any) must be set before: it decides the draft vocabulary.
    """
    features, labels = medusa_examples(train, heads.num_heads)
    vocab = heads.vocab(parts.lm_head)
    labels = vocab.indices_of(labels)
    before = medusa_acceptance(heads, vocab, held_out)

    def step_loss(rows: torch.Tensor) -> torch.Tensor:
        return medusa_loss(heads, vocab, features[rows], labels[rows])

    steps, first, last, spent = _fit(
        heads,
        step_loss,
        len(features),
        seconds=seconds,
        lr=lr,
        batch_size=batch_size,
        max_steps=max_steps,
        seed=seed,
        log=log,
    )
    after = medusa_acceptance(heads, vocab, held_out)
    return TrainReport(steps, spent, first, last, before, after)


def _fit(
    module: nn.Module,
    step_loss: Callable[[torch.Tensor], torch.Tensor],
    num_examples: int,
    *,
    seconds: float,
    lr: float,
    batch_size: int,
    max_steps: int | None,
    seed: int,
    log: Log | None,
) -> tuple[int, float, float, float]:
    """AdamW over random mini-batches of example indices until time (or steps) run out.

    Returns (steps, first loss, mean loss of the last steps, seconds).  The
    learning rate warms up over 20 steps and then stays constant.
    """
    module.train()
    generator = torch.Generator().manual_seed(seed)
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    started = time.perf_counter()
    last_log = started
    steps, first, recent = 0, math.nan, list[float]()
    while (max_steps is None or steps < max_steps) and (time.perf_counter() - started < seconds or steps == 0):
        rows = torch.randint(num_examples, (min(batch_size, num_examples),), generator=generator)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (steps + 1) / 20)
        loss = step_loss(rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        value = float(loss.detach())
        first = value if steps == 0 else first
        recent = [*recent[-19:], value]
        steps += 1
        if log is not None and time.perf_counter() - last_log > 15:
            last_log = time.perf_counter()
            log(f"step {steps}: loss {sum(recent) / len(recent):.4f} ({last_log - started:.0f} s)")
    module.eval()
    return steps, first, sum(recent) / max(len(recent), 1), time.perf_counter() - started


# -- EAGLE -----------------------------------------------------------------------------------------


@dataclass
class EagleBatch:
    """Right-padded sequences for :func:`eagle_rollout`, with room for ``num_steps`` of look-ahead."""

    token_ids: torch.Tensor
    """int64 ``[B, T + num_steps + 1]``."""
    hidden: torch.Tensor
    """``[B, T + num_steps, hidden]``: the target's final hidden states (the features the output regresses to)."""
    target_inputs: torch.Tensor
    """``[B, T, width]``: what the cache-filling pass reads per row, ``hidden`` (EAGLE-1) or the aux layers'
    outputs (EAGLE-3), before :meth:`~patchbay.plugins.spec_decode.heads.EagleDraftModel.target_features`."""
    next_token_ids: torch.Tensor
    """int64 ``[B, T + num_steps]``, -100 where padded."""
    lengths: torch.Tensor
    """``[B]``: tokens per sequence (``L``)."""
    prompt_lens: torch.Tensor
    num_rows: int
    """``T``: rows (positions 0..T-1) each step runs."""


def reads_aux(model: EagleDraftModel) -> bool:
    """Whether ``model`` reads the target's aux layers (EAGLE-3) rather than its final hidden state."""
    return isinstance(model, Eagle3DraftModel)


def eagle_batch(corpus: Corpus, indices: Sequence[int], num_steps: int, *, aux: bool = False) -> EagleBatch:
    """Sequences ``indices`` of ``corpus``, padded; ``aux``: the first pass reads :attr:`Corpus.aux` (EAGLE-3)."""
    if aux and corpus.aux is None:
        raise ValueError("an EAGLE-3 batch needs the corpus's aux hidden states (add_aux_hidden_states)")
    lengths = torch.tensor([len(corpus.token_ids[i]) for i in indices])
    num_rows = int(lengths.max()) - 1
    size = len(indices)
    hidden_size = corpus.hidden[indices[0]].shape[-1]
    token_ids = torch.zeros((size, num_rows + num_steps + 1), dtype=torch.long)
    hidden = torch.zeros((size, num_rows + num_steps, hidden_size))
    greedy = torch.full((size, num_rows + num_steps), -100, dtype=torch.long)
    for row, index in enumerate(indices):
        length = int(lengths[row])
        token_ids[row, :length] = corpus.token_ids[index]
        hidden[row, : length - 1] = corpus.hidden[index]
        greedy[row, : length - 1] = corpus.next_token_ids[index]
    prompt_lens = torch.tensor([corpus.prompt_lens[i] for i in indices])
    target_inputs = hidden[:, :num_rows]
    if aux:
        assert corpus.aux is not None
        target_inputs = torch.zeros((size, num_rows, corpus.aux[indices[0]].shape[-1]))
        for row, index in enumerate(indices):
            target_inputs[row, : int(lengths[row]) - 1] = corpus.aux[index]
    return EagleBatch(token_ids, hidden, target_inputs, greedy, lengths, prompt_lens, num_rows)


def unrolled_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    own_keys: list[torch.Tensor],
    own_values: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Attention of a drafting step for every drafting point at once (``[B, T, heads, D]`` each).

    Row ``p`` is the chain drafted from point ``p``: it sees the first
    pass's keys at positions ``0..p`` (causal) and the keys its own earlier
    drafting steps wrote (``own_keys[j][:, p]``), exactly what the paged
    cache holds for it at inference.
    """
    group = query.shape[-2] // keys.shape[-2]
    q = query.float().transpose(1, 2)  # [B, H, T, D]
    k = repeat_kv(keys, group).float().transpose(1, 2)
    v = repeat_kv(values, group).float().transpose(1, 2)
    num_rows = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, H, T, T]
    causal = torch.ones((num_rows, num_rows), dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    own_k = [repeat_kv(key, group).float().transpose(1, 2) for key in own_keys]
    own_v = [repeat_kv(value, group).float().transpose(1, 2) for value in own_values]
    own_scores = [(q * key).sum(-1, keepdim=True) * scale for key in own_k]  # [B, H, T, 1] each
    weights = torch.softmax(torch.cat((scores, *own_scores), dim=-1), dim=-1)
    output = weights[..., :num_rows] @ v
    for j, value in enumerate(own_v):
        output = output + weights[..., num_rows + j : num_rows + j + 1] * value
    return output.transpose(1, 2).to(query.dtype)


def eagle_rollout(
    model: EagleDraftModel,
    parts: TargetParts,
    batch: EagleBatch,
    num_steps: int,
    *,
    teacher_tokens: bool,
    feature_noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run ``num_steps`` drafting steps from every position at once; returns per step (features, input tokens).

    Step 1 is the cache-filling pass: row ``p`` fuses token ``p + 1`` with
    the target's feature at ``p`` (``hidden[p]``, or for EAGLE-3 the
    projection of its aux layers' outputs).  Step ``s`` of row ``p`` runs position
    ``p + s - 1`` on step ``s-1``'s output and a token: the true one
    (``teacher_tokens``, for training) or the previous step's draft (as at
    inference).  Step ``s``'s output at row ``p`` predicts ``hidden[p + s]``.
    """
    rotary = Rotary(parts)
    vocab = model.vocab(parts.lm_head)
    layer = model.layer
    num_rows = batch.num_rows
    positions = torch.arange(num_rows).expand(len(batch.lengths), num_rows)
    features = model.target_features(batch.target_inputs)
    if feature_noise:
        features = features + (torch.rand(features.shape, generator=generator) - 0.5) * 2 * feature_noise
    tokens = batch.token_ids[:, 1 : num_rows + 1]
    x = model.fuse(parts.embeddings(tokens), features)
    cos, sin = rotary(x, positions)
    query, keys, values = layer.qkv(x, cos, sin)
    attention = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        repeat_kv(keys, query.shape[-2] // keys.shape[-2]).transpose(1, 2),
        repeat_kv(values, query.shape[-2] // keys.shape[-2]).transpose(1, 2),
        is_causal=True,
        scale=layer.scale,
    ).transpose(1, 2)
    outputs, inputs = [layer.finish(x, attention)], [tokens]
    own_keys: list[torch.Tensor] = []
    own_values: list[torch.Tensor] = []
    for step in range(2, num_steps + 1):
        if teacher_tokens:
            tokens = batch.token_ids[:, step : num_rows + step]
        else:
            tokens = vocab.argmax(outputs[-1])
        x = model.fuse(parts.embeddings(tokens), outputs[-1])
        cos, sin = rotary(x, positions + step - 1)
        query, key, value = layer.qkv(x, cos, sin)
        own_keys.append(key)
        own_values.append(value)
        attention = unrolled_attention(query, keys, values, own_keys, own_values, layer.scale)
        outputs.append(layer.finish(x, attention))
        inputs.append(tokens)
    return outputs, inputs


def eagle_loss(
    model: EagleDraftModel,
    parts: TargetParts,
    batch: EagleBatch,
    num_steps: int,
    *,
    feature_noise: float,
    token_weight: float,
    token_rows: int,
    generator: torch.Generator,
    step_decay: float = 0.8,
) -> torch.Tensor:
    """Feature regression (smooth L1) on every valid row plus token cross-entropy on ``token_rows`` sampled rows.

    Step ``s`` (weighted ``step_decay ** (s-1)``) at row ``p`` is valid when
    ``hidden[p + s]`` exists; its token target is the target's greedy
    token after ``p + s``.  Feature targets are what the lm head reads, so
    matching them matches the target's choice; cross-entropy on a sample of
    rows keeps the vocabulary-wide projection affordable on a CPU.
    """
    outputs, _ = eagle_rollout(
        model, parts, batch, num_steps, teacher_tokens=True, feature_noise=feature_noise, generator=generator
    )
    rows = torch.arange(batch.num_rows)
    vocab = model.vocab(parts.lm_head)
    total = batch.hidden.new_zeros(())
    for step, output in enumerate(outputs, start=1):
        valid = (rows[None, :] + step) <= (batch.lengths[:, None] - 2)
        if not bool(valid.any()):
            continue
        target = batch.hidden[:, step : batch.num_rows + step]
        regression = F.smooth_l1_loss(output[valid], target[valid])
        labels = vocab.indices_of(batch.next_token_ids[:, step : batch.num_rows + step][valid])
        drafted = (labels >= 0).nonzero()[:, 0]
        chosen = drafted[torch.randperm(len(drafted), generator=generator)[:token_rows]]
        classification = output.new_zeros(())
        if len(chosen):
            classification = F.cross_entropy(vocab.logits(output[valid][chosen]).float(), labels[chosen])
        total = total + step_decay ** (step - 1) * (regression + token_weight * classification)
    return total


@torch.no_grad()
def eagle_acceptance(
    model: EagleDraftModel, parts: TargetParts, corpus: Corpus, num_drafts: int = 3, batch_size: int = 4
) -> Acceptance:
    """Greedy acceptance of the draft model's chains at every held-out drafting point, drafted as at inference."""
    model.eval()
    correct = []
    for start in range(0, len(corpus), batch_size):
        indices = list(range(start, min(start + batch_size, len(corpus))))
        batch = eagle_batch(corpus, indices, num_drafts, aux=reads_aux(model))
        outputs, inputs = eagle_rollout(model, parts, batch, num_drafts, teacher_tokens=False)
        # Step s's draft is step s+1's input token; the last step's is scored here.
        drafts = torch.stack([*inputs[1:], model.vocab(parts.lm_head).argmax(outputs[-1])], dim=-1)  # [B, T, K]
        for row, index in enumerate(indices):
            points = drafting_points(corpus, index, num_drafts)
            if len(points):
                targets = chain_targets(corpus, index, points, num_drafts)
                correct.append(drafts[row, points.start : points.stop] == targets)
    return Acceptance.from_correct(torch.cat(correct) if correct else torch.zeros((0, num_drafts), dtype=torch.bool))


def train_eagle(
    model: EagleDraftModel,
    parts: TargetParts,
    train: Corpus,
    held_out: Corpus,
    *,
    seconds: float,
    num_steps: int = 3,
    num_drafts: int = 3,
    lr: float = 1e-3,
    batch_size: int = 4,
    feature_noise: float = 0.05,
    token_weight: float = 0.5,
    token_rows: int = 256,
    max_steps: int | None = None,
    seed: int = 0,
    log: Log | None = None,
) -> TrainReport:
    """Fit the draft model (the target's embeddings and lm head stay frozen) for ``seconds`` of wall clock.

    The model's ``token_map`` (if any) must be set before: it decides the draft vocabulary.

    ``num_steps`` drafting steps are unrolled in training (``1``: plain
    teacher forcing, as in EAGLE-1; more: each later step learns from its
    own earlier predictions, as at inference: EAGLE-3's "training-time
    test").  An :class:`Eagle3DraftModel` trains the same way on the
    corpus's :attr:`Corpus.aux` (its first pass reads those layers), with
    the same losses: unlike the paper, its output still regresses to the
    target's final hidden state, a dense signal that matters when only a
    sample of rows pays for the vocabulary-wide token loss on a CPU.
    """
    parts.embeddings.requires_grad_(False)
    parts.lm_head.requires_grad_(False)
    before = eagle_acceptance(model, parts, held_out, num_drafts)
    generator = torch.Generator().manual_seed(seed + 1)

    def step_loss(rows: torch.Tensor) -> torch.Tensor:
        batch = eagle_batch(train, rows.tolist(), num_steps, aux=reads_aux(model))
        return eagle_loss(
            model,
            parts,
            batch,
            num_steps,
            feature_noise=feature_noise,
            token_weight=token_weight,
            token_rows=token_rows,
            generator=generator,
        )

    steps, first, last, spent = _fit(
        model,
        step_loss,
        len(train),
        seconds=seconds,
        lr=lr,
        batch_size=batch_size,
        max_steps=max_steps,
        seed=seed,
        log=log,
    )
    after = eagle_acceptance(model, parts, held_out, num_drafts)
    return TrainReport(steps, spent, first, last, before, after)
