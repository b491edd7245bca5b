"""The public plugin toolkit: what plugins, ours and a third party's alike, may build on besides the contract.

Each module's ``__all__`` is its public API, versioned as :data:`TOOLKIT_VERSION` under the contract's rules
(docs/reference.md#the-plugin-toolkit):

- :mod:`patchbay.toolkit.native_build`: C++ sources built with the machine's flags, once per CPU;
- :mod:`patchbay.toolkit.cpu`: the CPU's name and instruction-set flags;
- :mod:`patchbay.toolkit.tiles`: products over weights in output tiles, on shared helper threads;
- :mod:`patchbay.toolkit.block_tiles`: GGUF's quantized blocks as tiles, multiplied without a float copy;
- :mod:`patchbay.toolkit.fused_ops`: fused CPU ops (norms, activations, rotary, argmax and draws over logits);
- :mod:`patchbay.toolkit.int8_kv`: KV rows rounded into the int8 cache format and read back;
- :mod:`patchbay.toolkit.paths`: patchbay's cache folder;
- :mod:`patchbay.toolkit.model_files`: the bundled model and a model's Hugging Face directory;
- :mod:`patchbay.toolkit.hidden_states`: the outputs of chosen decoder layers, for drafters;
- :mod:`patchbay.toolkit.forward_context`: what attention layers reach the run's backend through (``attend``);
- :mod:`patchbay.toolkit.transformers_layers`: a transformers model's attention layers as layer specs.
- :mod:`patchbay.toolkit.local_files`: files a request names, opened below a folder without following links out.

The toolkit imports neither the worker nor the rooms above it (docs/layering.py), so the worker and the plugins
both stand on it.  Importing this package imports none of its modules (nor torch).
"""

from __future__ import annotations

from patchbay.contract.versions import TOOLKIT_VERSION

__all__ = ["TOOLKIT_VERSION"]
