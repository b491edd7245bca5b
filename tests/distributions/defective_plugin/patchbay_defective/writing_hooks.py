"""A class defined in the hooks module (no torch), but registering writes a file: a side effect."""

import tempfile
from pathlib import Path

from patchbay import hookimpl
from patchbay.interfaces import Sampler, SamplerCapabilities, SamplerOutput


class FileWritingSampler(Sampler):
    """Greedy argmax; its plugin writes a file whenever its hooks run."""

    capabilities = SamplerCapabilities(supported_params=frozenset(), supports_random=False)

    def sample(self, logits, metadata):
        return SamplerOutput(sampled_token_ids=logits.argmax(-1, keepdim=True))


@hookimpl
def register_samplers(register):
    (Path(tempfile.gettempdir()) / "patchbay-defective-registered.txt").write_text("registered\n")
    register("defect_writes_files", FileWritingSampler)
