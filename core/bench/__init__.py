"""``patchbay bench``: fixed workloads on patchbay and transformers side by side, against the machine's roofline.

Modules: :mod:`~patchbay.bench.workloads` (seeded requests),
:mod:`~patchbay.bench.engines` (patchbay, transformers ``generate``,
transformers continuous batching), :mod:`~patchbay.bench.machine` (measured
bandwidth and GEMM rate), :mod:`~patchbay.bench.roofline` (the model's cost and
the ceilings), :mod:`~patchbay.bench.report` (table and plot) and
:mod:`~patchbay.bench.command` (the command itself); for the cost axes,
:mod:`~patchbay.bench.checkpoints` (random checkpoints of three sizes),
:mod:`~patchbay.bench.axes` (the axis and neighbour tables) and
:mod:`~patchbay.bench.neighbour` (the busy neighbour).
"""
