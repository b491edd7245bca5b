"""Registers the defective implementations lazily, as a well-behaved hooks module does.

Each name is one defect; the comment says what it breaks in a real run.
"""

from patchbay import hookimpl


@hookimpl
def register_attention_backends(register):
    # Correct itself, but reads a builder that returns its first step's metadata forever: crashes at step 2.
    register("defect_stale_reader", "patchbay_defective.attention:StaleBuilderReader")
    # Correct itself, but reads a custom field its builder computes wrongly: wrong attention on decodes.
    register("defect_wrong_field_reader", "patchbay_defective.attention:WrongFieldReader")
    # Broken, and reads the example plugin's (correct) builder: that builder's own check must not fail for it.
    register("defect_foreign_reader", "patchbay_defective.attention:BrokenForeignReader")


@hookimpl
def register_attention_metadata_builders(register):
    register("defect_stale", "patchbay_defective.metadata:StaleBuilder")
    register("defect_wrong_field", "patchbay_defective.metadata:WrongFieldBuilder")
    # Named by no backend, and its result hides the common metadata: any backend an operator pairs it with fails.
    register("defect_no_common", "patchbay_defective.metadata:NoCommonBuilder")


@hookimpl
def register_samplers(register):
    # Says it is unavailable on every machine: every behavioural check of it skips.
    register("defect_unavailable", "patchbay_defective.sampler:UnavailableSampler")
    # Centres random rows on their mean: a grammar-masked row (-inf) becomes NaN, and the grammar gets the blame.
    register("defect_mean_centred", "patchbay_defective.sampler:MeanCentredSampler")
    # Draws random rows at temperature 1 whenever the batch asks for logprobs.
    register("defect_logprobs_temperature", "patchbay_defective.sampler:LogprobsAtTemperatureOneSampler")
    # Restarts each seeded generator every step: "coyrel, coyrel coyrel, ...".
    register("defect_restarting_seed", "patchbay_defective.sampler:RestartingGeneratorSampler")


@hookimpl
def register_drafters(register):
    # Proposes an id one past the vocabulary: the target's embedding cannot look it up.
    register("defect_out_of_range", "patchbay_defective.drafter:OutOfRangeDrafter")
    # Drafts for rows in `skip` (finished, partial prefills): work wasted, drafts the engine must drop.
    register("defect_ignores_skip", "patchbay_defective.drafter:IgnoresSkipDrafter")
    # Keeps drafts by batch index: stale once preemption reorders the rows.
    register("defect_index_cache", "patchbay_defective.drafter:IndexCacheDrafter")


@hookimpl
def register_kv_connectors(register):
    # Saves prefix-hit blocks when a request is admitted, before the step computes them: stores garbage.
    register("defect_early_save", "patchbay_defective.kv_connector:EarlySaveConnector")
    # Holds every finished request, but never reports those with nothing to save: the engine waits forever.
    register("defect_holds_forever", "patchbay_defective.kv_connector:HoldsForeverConnector")
    # Has no fault hook, so the kit cannot damage its entries.
    register("defect_no_fault_hook", "patchbay_defective.kv_connector:NoFaultHookConnector")
    # Correct with a `path`, broken with its defaults (saves zeros): only a default-mode check sees it.
    register("defect_default_mode", "patchbay_defective.kv_connector:BrokenDefaultsConnector")
    # A store other processes write, loaded without authentication: a forged entry loads, every output is wrong.
    register("defect_unauthenticated", "patchbay_defective.kv_connector:UnauthenticatedConnector")
    # A consumer that writes the store it should only read.
    register("defect_writing_consumer", "patchbay_defective.kv_connector:WritingConsumerConnector")


@hookimpl
def register_structured_output_backends(register):
    # Two requests with the same constraint share one matcher: both fail.
    register("defect_shared_state", "patchbay_defective.structured_output:SharedStateBackend")
    # A draft token refused half way leaves its fitting bytes in the state: requests fail under n-gram drafting.
    register("defect_half_way", "patchbay_defective.structured_output:HalfWayBackend")
    # Token bytes from Latin-1: non-ASCII text comes out wrong ("caf\ufffd").
    register("defect_latin1", "patchbay_defective.structured_output:Latin1Backend")
    # Masks ignore a half-sent UTF-8 character: the request fails.
    register("defect_half_sent", "patchbay_defective.structured_output:HalfSentBackend")
    # Six seconds per compile: the run is many times slower, with no warning.
    register("defect_slow_compile", "patchbay_defective.structured_output:SlowCompileBackend")
    # Concurrent compiles swap grammars.
    register("defect_racy_compile", "patchbay_defective.structured_output:RacyCompileBackend")
    # Ids past the tokenizer (the logits' padding) allowed: the model can emit tokens that spell nothing.
    register("defect_padded_ids", "patchbay_defective.structured_output:PaddedIdsBackend")


@hookimpl
def register_architectures(register):
    # Declares no sliding window for Mistral's layers: prompts longer than the window attend too far back.
    register("defect_forgets_window", "patchbay_defective.architecture:ForgetsWindowArchitecture")
    # Every layer attends as layer 0: one cache written by all layers, the others never written.
    register("defect_one_cache", "patchbay_defective.architecture:OneCacheArchitecture")
    # Numbers positions itself, right only for one request prefilled whole: wrong once requests share a step.
    register("defect_counts_positions", "patchbay_defective.architecture:CountsPositionsArchitecture")
