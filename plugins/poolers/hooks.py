"""Registers the built-in poolers (lazily: nothing heavy is imported here)."""

from patchbay import hookimpl


@hookimpl
def register_poolers(register):
    register(
        "mean",
        "patchbay.plugins.poolers.embedding:MeanPooler",
        description="embedding: the mean of every prompt token's hidden state (sentence-transformers' mean)",
    )
    register(
        "cls",
        "patchbay.plugins.poolers.embedding:CLSPooler",
        description="embedding: the first token's hidden state (BERT's [CLS])",
    )
    register(
        "last",
        "patchbay.plugins.poolers.embedding:LastTokenPooler",
        description="embedding: the last token's hidden state (decoder embedders: Qwen3-Embedding, e5-mistral)",
    )
    register(
        "classify",
        "patchbay.plugins.poolers.classification:ClassifyPooler",
        description="the model's classification head: softmax over its labels",
    )
    register(
        "score",
        "patchbay.plugins.poolers.classification:ScorePooler",
        description="a cross-encoder's relevance of a pair: the sigmoid of its head's one logit",
    )
