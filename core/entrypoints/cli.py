"""The ``patchbay`` command line: plugins, config, check, run, tune, serve, chat, models and bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from patchbay.contract.registry import (
    PluginError,
    Registration,
    Registry,
    default_registry,
    parse_reference,
    registry_for,
)
from patchbay.contract.settings import ConfigError, dump_settings, load_settings
from patchbay.contract.versions import CONTRACT_VERSIONS, declared_version
from patchbay.engine import ModelLoadError
from patchbay.entrypoints.cli_flags import add_flags, flag_sources, model_argument
from patchbay.entrypoints.result_file import ResultsNotWritten


def _registry(args: argparse.Namespace) -> Registry:
    if getattr(args, "strict", False):
        return default_registry(strict=True)
    return default_registry()


def _origin(origin: Any) -> dict[str, str]:
    return {"plugin": origin.plugin, "distribution": origin.distribution, "version": origin.version}


def _describe(registration: Registration) -> dict[str, Any]:
    row: dict[str, Any] = {
        "kind": registration.kind.name,
        "name": registration.name,
        **_origin(registration.origin),
        "target": registration.target_path,
        "description": registration.description,
    }
    try:
        implementation = registration.resolve()
    except PluginError as exc:
        row.update(available=False, reason=str(exc), capabilities=None, contract_version=None, known_gaps={})
        return row
    reason = implementation.unavailable_reason()
    doc = (implementation.__doc__ or "").strip().splitlines()
    row.update(
        available=reason is None,
        reason=reason,
        capabilities=implementation.capabilities.as_dict(),
        contract_version=declared_version(implementation),
        known_gaps=dict(implementation.known_gaps),
        description=registration.description or (doc[0] if doc else ""),
    )
    if registration.kind.name == "attention":
        row["metadata_builder"] = getattr(implementation, "metadata_builder", None)
    return row


def _served(capabilities: dict[str, Any]) -> str:
    """An architecture plugin's Hugging Face architectures, as ``patchbay plugins`` lists them."""
    names = ", ".join(capabilities["architectures"]) or "none by name"
    any_other = capabilities["other_transformers_architectures"]
    other = "; and any other transformers decoder it can route" if any_other else ""
    sharded = ", ".join(capabilities["tensor_parallel"]) or "none"
    return f"serves: {names}{other} (tensor-parallel: {sharded})"


def _plugins_report(registry: Registry, kind: str | None) -> dict[str, Any]:
    """What ``patchbay plugins --json`` prints: implementations, load failures, what the policy kept out, conflicts."""
    return {
        "plugins": [_describe(r) for r in registry.registrations(kind)],
        "failures": [
            {**_origin(f.origin), "error": f.error, "traceback": f.traceback_summary} for f in registry.failures
        ],
        "excluded": [{"what": e.what, "rule": e.rule, "reference": e.reference} for e in registry.excluded],
        "conflicts": [
            {"kind": c.kind.name, "name": c.name, "claimants": [_origin(c.first), _origin(c.second)], "message": str(c)}
            for c in registry.conflicts
        ],
    }


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = _registry(args)
    report = _plugins_report(registry, args.kind)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    current_kind = None
    builders = set(registry.names("attention_metadata_builder"))
    for row in report["plugins"]:
        if row["kind"] != current_kind:
            current_kind = row["kind"]
            print(f"\n{current_kind} (contract {CONTRACT_VERSIONS[current_kind]}):")
        status = "available" if row["available"] else f"unavailable: {row['reason']}"
        version = f" {row['version']}" if row["version"] else ""
        contract = row["contract_version"] or "undeclared"
        print(f"  {row['name']:<16} {row['distribution']}{version}  contract {contract}  [{status}]")
        if row["description"]:
            print(f"  {'':<16} {row['description']}")
        if row["kind"] == "architecture" and row["capabilities"]:
            print(f"  {'':<16} {_served(row['capabilities'])}")
        if not args.verbose:
            continue
        if "metadata_builder" in row:
            missing = "" if row["metadata_builder"] in builders else "  (NOT INSTALLED: runs will fail)"
            print(f"  {'':<18}metadata builder: {row['metadata_builder']}{missing}")
        for test, why in (row["known_gaps"] or {}).items():
            print(f"  {'':<18}known gap: {test}: {why}")
        for key, value in (row["capabilities"] or {}).items():
            print(f"  {'':<18}{key}: {value}")
    for failure in report["failures"]:
        version = f" {failure['version']}" if failure["version"] else ""
        print(f"\nbroken plugin {failure['plugin']!r} from {failure['distribution']}{version}: {failure['error']}")
        print(textwrap.indent(failure["traceback"], "    "))
    for exclusion in registry.excluded:
        print(f"\nnot loaded: {exclusion}")
    for conflict in report["conflicts"]:
        print(f"\nconflict: {conflict['message']}")
    return 0


def _load(args: argparse.Namespace, path: str | None, flags: list[Any] | None = None) -> Any:
    """The settings of ``path``, the environment, typed ``flags`` and ``--set``, plugins checked; load failures
    are warned about."""
    settings = load_settings(path, overrides=args.set or [], flags=flags or [], registry=registry_for)
    _warn_about_failures(registry_for(settings.plugins))
    return settings


def cmd_config_validate(args: argparse.Namespace) -> int:
    from patchbay.entrypoints.run_command import read_requests

    settings = _load(args, args.file)
    requests = read_requests(settings, args.file) if settings.inputs.prompts or settings.inputs.file else []
    print(f"{args.file}: valid ({len(requests)} requests)")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    print(dump_settings(_load(args, args.file)), end="")
    return 0


def _options_after_the_reference(pytest_args: list[str]) -> tuple[str | None, list[str]]:
    """``--options JSON`` (or ``--options=JSON``) written after ``KIND:NAME``, and the arguments left for pytest
    (which has no such flag)."""
    for index, word in enumerate(pytest_args):
        if word == "--options" and index + 1 < len(pytest_args):
            return pytest_args[index + 1], pytest_args[:index] + pytest_args[index + 2 :]
        if word.startswith("--options="):
            return word.partition("=")[2], pytest_args[:index] + pytest_args[index + 1 :]
    return None, pytest_args


def _check_options(args: argparse.Namespace, kind: str) -> dict[str, Any] | None:
    """The ``--options`` JSON object of ``patchbay check``, or ``None``; a usage error names what is wrong."""
    from patchbay.testing import SUITES

    later, args.pytest_args = _options_after_the_reference(args.pytest_args)
    if later is not None:
        if args.options is not None:
            raise CheckUsageError("--options is given twice, before and after KIND:NAME")
        args.options = later
    if args.options is None:
        return None
    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as exc:
        raise CheckUsageError(f"--options is not JSON ({exc}): {args.options!r}") from None
    if not isinstance(options, dict):
        raise CheckUsageError(f"--options must be a JSON object of the plugin's options, got {args.options!r}")
    if not SUITES[kind].takes_options:
        raise CheckUsageError(f"the {kind} suite builds plugins with their default options; --options does not apply")
    return options


class CheckUsageError(ValueError):
    """``patchbay check`` was given options it cannot use."""


def cmd_check(args: argparse.Namespace) -> int:
    import pytest

    kind, name = parse_reference(args.reference)
    try:
        options = _check_options(args, kind.name)
    except CheckUsageError as exc:
        print(f"patchbay: error: {exc}", file=sys.stderr)
        return 2
    registry = default_registry()
    _warn_about_failures(registry)
    registration = registry.get(kind.name, name)  # fail early, with the available names
    implementation = registration.resolve()
    reason = implementation.unavailable_reason()
    if reason and not args.allow_unavailable:
        print(
            f"patchbay: error: {kind.name}:{name} is unavailable here: {reason}; its behavioural checks cannot run, "
            "so it cannot pass (--allow-unavailable runs the rest and skips them)",
            file=sys.stderr,
        )
        return 1
    with tempfile.TemporaryDirectory(prefix="patchbay-check-") as tmp:
        test_file = Path(tmp) / f"test_{kind.name}_{name.replace('-', '_')}.py"
        options_text = "None" if options is None else f"json.loads({json.dumps(options)!r})"
        test_file.write_text(
            "import json\n\nfrom patchbay.testing import suite_for\n\n"
            f"TestConformance = suite_for({kind.name!r}, {name!r}, options={options_text})\n"
        )
        (Path(tmp) / "pytest.ini").write_text("[pytest]\n")
        mode = " (strict: a skipped behavioural check fails)" if args.strict else ""
        given = f" with options {json.dumps(options)}" if options is not None else ""
        print(f"conformance suite for {kind.name}:{name}{given}{mode}")
        strict = ["--patchbay-strict"] if args.strict else []
        code = pytest.main(
            [
                str(test_file),
                "-v",
                "-rA",
                "-p",
                "no:cacheprovider",
                "--rootdir",
                tmp,
                "-c",
                str(Path(tmp) / "pytest.ini"),
                *strict,
                *args.pytest_args,
            ]
        )
    return int(code)


def _warn_about_failures(registry: Registry) -> None:
    """Say on stderr which plugins failed to load: a name they would have registered is missing for that reason."""
    for failure in registry.failures:
        print(
            f"patchbay: warning: {failure} (its implementations are not available; `patchbay plugins` shows "
            "the traceback)",
            file=sys.stderr,
        )


def cmd_run(args: argparse.Namespace) -> int:
    from patchbay.engine import run_launched_rank
    from patchbay.entrypoints.run_command import run_from_settings

    settings = _load(args, args.config, flag_sources(args))
    # Under torchrun, ranks other than 0 serve rank 0's steps instead of running the job.
    status = run_launched_rank(settings)
    return status if status is not None else run_from_settings(settings, config_path=args.config)


def cmd_tune(args: argparse.Namespace) -> int:
    from patchbay.engine import measure_machine_defaults

    from patchbay.contract.registry import registry_for

    settings = load_settings(args.config, overrides=args.set or [])
    tuning = measure_machine_defaults(settings, registry_for(settings.plugins), fresh=not args.if_missing)
    if tuning.provisional:  # on stderr too: `make` sends the table to /dev/null
        print(
            "patchbay tune: measured on a busy machine, so nothing was cached: the next start measures again "
            f"({'; '.join(tuning.noise.reasons if tuning.noise else [])})",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps({**dataclasses.asdict(tuning), "provisional": tuning.provisional}, indent=2))
        return 0
    print(
        f"cpu: {tuning.cpu}; native dtypes: {', '.join(tuning.native_dtypes)}; {tuning.threads} threads, "
        f"torch {tuning.torch_version}"
    )
    print("one decoder layer's linears, ms per call:")
    buckets = list(next(iter(tuning.measurements.values())))
    width = max(len(path) for path in tuning.measurements) + 2
    print(f"  {'path':<{width}}" + "".join(f"{rows + ' rows':>12}" for rows in buckets))
    for path, seconds in tuning.measurements.items():
        print(
            f"  {path:<{width}}"
            + "".join(f"{seconds[rows] * 1e3:>12.3f}" if rows in seconds else f"{'-':>12}" for rows in buckets)
        )
    print(f"chosen: {tuning.describe()}")
    if tuning.noise is not None and tuning.noise.reference_seconds is not None:
        cpu_wait = "unknown" if tuning.noise.cpu_wait is None else f"{100 * tuning.noise.cpu_wait:.0f}%"
        print(
            f"noise check: {tuning.noise.rounds} rounds, {tuning.noise.rounds_spread:.2f}x apart; reference kernel "
            f"{tuning.noise.reference_seconds * 1e3:.3f} ms, spread {tuning.noise.reference_spread:.2f}x; threads "
            f"waiting for a core {cpu_wait}"
        )
    if not tuning.provisional:
        print("(cached for this CPU, torch and model shape; runs with model.dtype, runtime.linear_kernel auto use it)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from patchbay.engine import run_launched_rank
    from patchbay.entrypoints.serve.command import serve_from_settings

    settings = _load_for_model(args)
    if settings.runtime.data_parallel_size > 1:  # replicas behind a router (docs/fleet.md)
        from patchbay.entrypoints.serve.fleet.command import serve_fleet, sources_as_overrides

        config, model = model_argument(args.model, args.config)
        overrides = [*sources_as_overrides([*model, *flag_sources(args)]), *(args.set or [])]
        return serve_fleet(settings, config, overrides)
    status = run_launched_rank(settings)  # as in cmd_run: only rank 0 serves
    return status if status is not None else serve_from_settings(settings)


def _load_for_model(args: argparse.Namespace) -> Any:
    """The settings of ``serve`` and ``chat``: ``MODEL`` or ``--config``, the environment, the typed flags and
    ``--set``."""
    config, model = model_argument(args.model, args.config)
    return _load(args, config, [*model, *flag_sources(args)])


def cmd_chat(args: argparse.Namespace) -> int:
    from patchbay.entrypoints.interactive_chat import ChatOptions, chat_in_terminal

    options = ChatOptions(system=args.system, max_tokens=args.max_tokens, temperature=args.temperature)
    return chat_in_terminal(_load_for_model(args), options)


def cmd_models_path(args: argparse.Namespace) -> int:
    from patchbay.toolkit.model_files import resolve_model_dir

    print(resolve_model_dir(args.model))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from patchbay.bench.command import bench_command

    return bench_command(args)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from patchbay.bench.command import add_arguments

    add_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="patchbay", description="An LLM inference runner built of plugins.")
    parser.add_argument("--version", action="version", version=f"patchbay {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    plugins = sub.add_parser("plugins", help="list every installed plugin, its origin and capabilities")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.add_argument("--strict", action="store_true", help="a plugin that fails to load is an error")
    plugins.add_argument("--kind", help="only this kind")
    plugins.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show each backend's metadata builder, declared known gaps and capabilities",
    )
    plugins.set_defaults(handler=cmd_plugins)

    config = sub.add_parser("config", help="validate or show a YAML configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    for name, handler, help_text in (
        ("validate", cmd_config_validate, "check a YAML file, its plugin names and their options"),
        ("show", cmd_config_show, "print the effective configuration after defaults and overrides"),
    ):
        command = config_sub.add_parser(name, help=help_text)
        command.add_argument("file")
        command.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a setting")
        command.set_defaults(handler=handler)

    check = sub.add_parser("check", help="run the conformance suite against a plugin (KIND:NAME)")
    check.add_argument("reference", metavar="KIND:NAME")
    check.add_argument(
        "--strict",
        action="store_true",
        help="a behavioural check skipped for any reason but a limit the plugin declares fails",
    )
    check.add_argument(
        "--allow-unavailable",
        action="store_true",
        help="run the checks of a plugin that is unavailable here (its behavioural checks skip)",
    )
    check.add_argument(
        "--options",
        metavar="JSON",
        help="the plugin's options as a JSON object, before or after KIND:NAME (default: the kind's "
        "PATCHBAY_TEST_<KIND>_OPTIONS, else each suite's own; the parser suites also run every combination of the "
        "finite-valued options left out)",
    )
    check.add_argument(
        "pytest_args",
        nargs=argparse.REMAINDER,
        help="extra pytest arguments (everything after KIND:NAME; give --strict, --allow-unavailable and --options "
        "before it)",
    )
    check.set_defaults(handler=cmd_check)

    run = sub.add_parser("run", help="run the job a YAML file describes")
    run.add_argument("config")
    run.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a setting")
    add_flags(run, "run")
    run.set_defaults(handler=cmd_run)

    tune = sub.add_parser("tune", help="measure this CPU's fastest dtype and linear paths for a model, and cache them")
    tune.add_argument("config", nargs="?", help="a YAML file naming the model (default: the bundled model)")
    tune.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a setting")
    tune.add_argument("--json", action="store_true", help="machine-readable output")
    tune.add_argument(
        "--if-missing",
        action="store_true",
        help="measure only where nothing is cached for this CPU, torch and model shape (what `make` "
        "runs at install, so a reinstall on a busy machine never replaces a quiet measurement)",
    )
    tune.set_defaults(handler=cmd_tune)

    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (or the model of --config) over an OpenAI-compatible HTTP API until SIGTERM.",
    )
    _add_model_arguments(serve)
    add_flags(serve, "serve")
    serve.set_defaults(handler=cmd_serve)

    chat = sub.add_parser(
        "chat",
        help="chat with a model in the terminal, answers streamed",
        description="Chat with MODEL in the terminal. /clear starts over, /exit (or Ctrl-D) leaves, Ctrl-C stops "
        "an answer.",
    )
    _add_model_arguments(chat)
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    chat.add_argument("--max-tokens", type=int, metavar="N", help="most tokens per answer (default: the context)")
    chat.add_argument("--temperature", type=float, default=0.7, metavar="X", help="sampling temperature (0: greedy)")
    add_flags(chat, "chat")
    chat.set_defaults(handler=cmd_chat)

    models = sub.add_parser("models", help="where models live")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    path = models_sub.add_parser(
        "path",
        help="print the Hugging Face folder a model loads from (a .gguf file is converted once first)",
    )
    path.add_argument("model", nargs="?", default="default", metavar="MODEL", help="default, a directory or a .gguf")
    path.set_defaults(handler=cmd_models_path)

    bench = sub.add_parser(
        "bench", help="benchmark patchbay against transformers on fixed workloads, with the roofline"
    )
    add_bench_arguments(bench)
    bench.set_defaults(handler=cmd_bench)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="a Hugging Face model directory, a .gguf file or 'default' (the bundled SmolLM2-135M-Instruct; the "
        "default unless --config names another); a settings .yaml file here is read as --config",
    )
    parser.add_argument("--config", metavar="FILE", help="a settings YAML file (the flags override it)")
    parser.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override any setting")


def _version() -> str:
    import patchbay

    return patchbay.__version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ResultsNotWritten as exc:
        print(f"patchbay: error: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, PluginError, ModelLoadError, ValueError) as exc:
        # ValueError: a request or size the engine refuses (it names the request or setting at fault).
        print(f"patchbay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
