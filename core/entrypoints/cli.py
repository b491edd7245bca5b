"""The ``patchbay`` command line: plugins, config, check, run, tune, serve and bench."""

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


def _load(args: argparse.Namespace, path: str) -> Any:
    settings = load_settings(path, overrides=args.set or [], registry=registry_for)
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


def cmd_check(args: argparse.Namespace) -> int:
    import pytest

    kind, name = parse_reference(args.reference)
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
        test_file.write_text(
            f"from patchbay.testing import suite_for\nTestConformance = suite_for({kind.name!r}, {name!r})\n"
        )
        (Path(tmp) / "pytest.ini").write_text("[pytest]\n")
        mode = " (strict: a skipped behavioural check fails)" if args.strict else ""
        print(f"conformance suite for {kind.name}:{name}{mode}")
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

    settings = _load(args, args.config)
    # Under torchrun, ranks other than 0 serve rank 0's steps instead of running the job.
    status = run_launched_rank(settings)
    return status if status is not None else run_from_settings(settings, config_path=args.config)


def cmd_tune(args: argparse.Namespace) -> int:
    from patchbay.engine import measure_machine_defaults

    settings = load_settings(args.config, overrides=args.set or [])
    tuning = measure_machine_defaults(settings, fresh=not args.if_missing)
    if args.json:
        print(json.dumps(dataclasses.asdict(tuning), indent=2))
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
    print("(cached for this CPU, torch and model shape; runs with model.dtype, runtime.linear_kernel auto use it)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from patchbay.engine import run_launched_rank
    from patchbay.entrypoints.serve.command import serve_from_settings

    settings = load_settings(args.config, overrides=args.set or [], registry=registry_for)
    status = run_launched_rank(settings)  # as in cmd_run: only rank 0 serves
    return status if status is not None else serve_from_settings(settings)


def cmd_bench(args: argparse.Namespace) -> int:
    from patchbay.bench.command import bench_command

    return bench_command(args)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from patchbay.bench.command import add_arguments

    add_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="patchbay", description="An LLM inference runner built of plugins.")
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
        "pytest_args",
        nargs=argparse.REMAINDER,
        help="extra pytest arguments (everything after KIND:NAME; give --strict and --allow-unavailable before it)",
    )
    check.set_defaults(handler=cmd_check)

    run = sub.add_parser("run", help="run the job a YAML file describes")
    run.add_argument("config")
    run.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a setting")
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

    serve = sub.add_parser("serve", help="serve the model of a YAML file over an OpenAI-compatible HTTP API")
    serve.add_argument("config")
    serve.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a setting")
    serve.set_defaults(handler=cmd_serve)

    bench = sub.add_parser(
        "bench", help="benchmark patchbay against transformers on fixed workloads, with the roofline"
    )
    add_bench_arguments(bench)
    bench.set_defaults(handler=cmd_bench)
    return parser


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
