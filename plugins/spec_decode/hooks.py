"""Registers the built-in speculative-decoding drafters (lazily: nothing heavy is imported here)."""

from patchbay import hookimpl


@hookimpl
def register_drafters(register):
    register(
        "ngram",
        "patchbay.plugins.spec_decode.ngram:NgramDrafter",
        description="prompt lookup: proposes what followed the latest earlier occurrence of the last n-gram",
    )
    register(
        "medusa",
        "patchbay.plugins.spec_decode.medusa:MedusaDrafter",
        description="Medusa heads over the target's last hidden state",
    )
    register(
        "eagle",
        "patchbay.plugins.spec_decode.eagle:EagleDrafter",
        description="EAGLE draft model: one decoder layer over token embeddings and target hidden states",
    )
    register(
        "eagle3",
        "patchbay.plugins.spec_decode.eagle3:Eagle3Drafter",
        description="EAGLE-3 draft model: the eagle layer over an fc of a low, a middle and a high target layer",
    )
