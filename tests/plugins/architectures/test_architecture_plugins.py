"""The built-in architectures against the kit: each served architecture's tiny random checkpoint, in the engine,
against transformers' own greedy tokens (alone, and under chunked prefill, prefix hits and preemption), over two
tensor-parallel ranks where the plugin shards it, and its layers' attention calls against their declared specs."""

from __future__ import annotations

import pytest

from patchbay.testing import ArchitectureSuite


@pytest.mark.slow
class TestTransformers(ArchitectureSuite):
    plugin_name = "transformers"


class TestDeepseekMLA(ArchitectureSuite):
    plugin_name = "deepseek_mla"


class TestStableLM(ArchitectureSuite):
    plugin_name = "stablelm"
