"""One replica of ``patchbay serve --data-parallel-size N``: ``python -m patchbay.entrypoints.serve.fleet.replica
CONFIG [--set KEY=VALUE ...]`` serves one engine (the fleet's supervisor starts it; it starts no replicas)."""

from __future__ import annotations

import argparse
import sys

from patchbay.contract.registry import registry_for
from patchbay.contract.settings import ConfigError, load_settings
from patchbay.entrypoints.serve.command import serve_from_settings


def main(argv: list[str] | None = None) -> int:
    """Serve one replica until SIGTERM; the process's exit status."""
    parser = argparse.ArgumentParser(prog="patchbay-replica", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config, overrides=args.set, registry=registry_for)
    except ConfigError as exc:
        print(f"patchbay replica: {exc}", file=sys.stderr)
        return 2
    return serve_from_settings(settings, stream=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
