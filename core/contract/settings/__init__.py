"""Settings of a whole run: pydantic models, loaded from YAML, overridden from env and CLI.

Precedence, lowest first: defaults, the YAML file, environment variables
(``PATCHBAY_`` prefix, ``__`` between nested keys, e.g.
``PATCHBAY_SCHEDULER__MAX_NUM_SEQS=8``), typed command-line flags
(``--max-model-len 4096``), then ``--set key.path=value`` overrides.  Unknown keys are errors everywhere.  Every
problem is reported with where the offending value came from (file, env var
or CLI flag), its key path and, for plugin sections, the plugin.
"""

from __future__ import annotations

from patchbay.contract.settings.engine_sections import (
    CacheSettings,
    KVEventsSettings,
    ModelSettings,
    RuntimeSettings,
    SchedulerSettings,
)
from patchbay.contract.settings.job_sections import (
    InputSettings,
    MultimodalSettings,
    OutputSettings,
    RouterSettings,
    ServerSettings,
)
from patchbay.contract.settings.loading import (
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    ChosenPlugin,
    ConfigError,
    ConfigProblem,
    Settings,
    cli_overrides,
    dump_settings,
    env_overrides,
    load_settings,
    plugin_options,
    read_yaml,
    validate_plugin_choices,
)
from patchbay.contract.settings.plugin_sections import (
    AttentionSettings,
    ChatSettings,
    KVConnectorSettings,
    LoRASettings,
    PluginPolicy,
    PoolingSettings,
    SamplerSettings,
    SpecDecodeSettings,
    StructuredOutputSettings,
)
from patchbay.contract.settings.sections import DEFAULT_MODEL, PluginChoice, Section

__all__ = [
    "DEFAULT_MODEL",
    "ENV_NESTED_DELIMITER",
    "ENV_PREFIX",
    "AttentionSettings",
    "CacheSettings",
    "ChatSettings",
    "ChosenPlugin",
    "ConfigError",
    "ConfigProblem",
    "InputSettings",
    "KVConnectorSettings",
    "KVEventsSettings",
    "LoRASettings",
    "ModelSettings",
    "MultimodalSettings",
    "OutputSettings",
    "PluginChoice",
    "PluginPolicy",
    "PoolingSettings",
    "RouterSettings",
    "RuntimeSettings",
    "SamplerSettings",
    "SchedulerSettings",
    "Section",
    "ServerSettings",
    "Settings",
    "SpecDecodeSettings",
    "StructuredOutputSettings",
    "cli_overrides",
    "dump_settings",
    "env_overrides",
    "load_settings",
    "plugin_options",
    "read_yaml",
    "validate_plugin_choices",
]
