"""Poolers: the hidden states of a finished prompt in, one vector out (an embedding, class probabilities, a score).

An engine either generates or pools (the ``pooling:`` section of the settings, as vLLM's ``--runner pooling``).
A pooling engine runs each prompt through the model like a prefill, chunk by chunk for a causal model, whole
for an encoder-only one, and never samples: once a prompt's last token has run, the runner hands its hidden
states to the run's pooler and the request finishes with the pooler's vector.

The runner keeps only the rows a pooler reads (:attr:`Pooler.positions`): ``"last"`` needs the prompt's last
token only, so a causal model's chunks keep nothing and prefix caching serves it; ``"first"`` and ``"all"``
need the prompt from its first token, so such requests never start from a prefix-cache hit.

What the vector means is fixed here, for every pooler of a task, and the conformance suite checks it:

- ``embed``: the embedding, ``[embedding_size]``.  With ``dimensions=d`` (Matryoshka) it is the first ``d``
  features of the embedding *before* normalization, then normalized if asked: ``l2(e[:d])``, never ``l2(e)[:d]``.
  With ``normalize`` its L2 norm is 1.
- ``classify``: one value per label of the model's classification head: with ``activation`` the softmax of the
  head's logits (the sigmoid for a single label), without it the logits.
- ``score``: one value, a cross-encoder's relevance of the pair in the prompt: with ``activation`` the sigmoid
  of the head's single logit, without it the logit.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

PoolingTask = Literal["embed", "classify", "score"]
POOLING_TASKS = ("embed", "classify", "score")
"""What a pooling request asks for: an embedding, class probabilities, or a cross-encoder's score of a pair."""

Positions = Literal["all", "first", "last"]
"""Which prompt positions' hidden states a pooler reads: every one, the first (CLS) or the last."""


@dataclass(frozen=True)
class PoolingParams:
    """What one pooling request asks of the pooler (vLLM's ``PoolingParams``)."""

    dimensions: int | None = None
    """``embed``: keep the first ``dimensions`` features (Matryoshka), cut before normalizing; ``None``: all."""
    normalize: bool | None = None
    """``embed``: L2-normalize the embedding; ``None``: the pooler's default (its ``normalize`` option)."""
    activation: bool | None = None
    """``classify`` and ``score``: softmax (sigmoid for one label) over the head's logits; ``None``: the pooler's
    default (its ``activation`` option)."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true, false or null, got {value!r}")


@dataclass(frozen=True)
class PoolerConfig(ServingConfig):
    """What a run asks its pooler to serve."""

    task: str = "embed"
    """The run's task (one of :data:`POOLING_TASKS`): the engine refuses requests of another."""
    hidden_size: int = 64
    """Features of each hidden-state row."""
    causal: bool = True
    """Whether the model attends causally (a decoder: its last token has seen the whole prompt) or
    bidirectionally (an encoder-only model: every token has)."""
    num_labels: int | None = None
    """Outputs of the model's classification head; ``None``: the model has none."""


@dataclass(frozen=True)
class PoolerCapabilities(Capabilities):
    """What a pooler can serve.  Poolers run on whatever device holds the hidden states."""

    devices: tuple[str, ...] = ("cpu", "cuda", "mps")
    tasks: tuple[str, ...] = ("embed",)
    """The tasks its vectors answer (see the module docstring for what each means)."""

    def reasons(self, config: ServingConfig) -> list[str]:
        found = super().reasons(config)
        if not isinstance(config, PoolerConfig):
            return found
        if config.task not in self.tasks:
            found.append(f"task {config.task!r} not served (serves {', '.join(self.tasks)})")
        if config.task in ("classify", "score") and config.num_labels is None:
            found.append(f"task {config.task!r} needs a model with a classification head; this one has none")
        if config.task == "score" and config.num_labels not in (None, 1):
            found.append(f"task 'score' needs a head with one label; this model's has {config.num_labels}")
        return found


ClassificationHead = Callable[["torch.Tensor"], "torch.Tensor"]
"""The model's classification head: pooled rows ``[n, hidden]`` to logits ``[n, num_labels]`` (for a BERT
cross-encoder: its pooler's dense layer and tanh, then its classifier)."""


@dataclass
class PoolingBatch:
    """The requests whose prompts finished in one step, with the hidden states their pooler reads.

    Request ``i`` owns rows ``row_starts[i]:row_starts[i+1]`` of :attr:`hidden_states`: every prompt
    position for a pooler reading ``"all"``, one row for ``"first"`` and ``"last"``.  Two requests of 3 and 2
    tokens, pooled over all positions::

        row_starts  = [0, 3, 5]
        prompt_lens = [3, 2]
    """

    req_ids: list[str]
    hidden_states: torch.Tensor
    """``[rows, hidden_size]`` in the model's dtype."""
    row_starts: list[int]
    prompt_lens: list[int]
    """Tokens of each request's prompt."""
    params: list[PoolingParams]
    head: ClassificationHead | None = None
    """The model's classification head (``None``: the model has none)."""

    @property
    def num_requests(self) -> int:
        return len(self.req_ids)

    def rows(self, index: int) -> torch.Tensor:
        """Request ``index``'s rows of :attr:`hidden_states`."""
        return self.hidden_states[self.row_starts[index] : self.row_starts[index + 1]]


class Pooler(Plugin):
    """Turns the hidden states of finished prompts into one vector each; chosen by ``pooling: {name: NAME}``."""

    kind: ClassVar[str] = "pooler"
    capabilities: ClassVar[PoolerCapabilities] = PoolerCapabilities()
    positions: Positions = "all"
    """Which prompt positions :meth:`pool` reads (a class default an instance may narrow from its options)."""

    def __init__(self, options: BaseModel | None = None, *, config: PoolerConfig | None = None) -> None:
        """Create the pooler with its validated ``options`` for the run's ``config`` (``None``: the defaults)."""
        self.options = options if options is not None else self.Options()
        self.config = config if config is not None else PoolerConfig()

    @abstractmethod
    def pool(self, batch: PoolingBatch) -> Sequence[torch.Tensor]:
        """One float32 1-D tensor per request of ``batch``, in its order, on the batch's device.

        A request's vector depends on its own rows and parameters only, never on the batch around it; what
        the vector means for each task is fixed by the module docstring.
        """
