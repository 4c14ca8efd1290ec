"""The `kiln` console script: the engine's commands (build, run, inspect, conformance: engine_core.cli) plus
`kiln serve` (server.cli) and `kiln perf` (load_tests.perf).

It sits above the three packages so that the dependency points the right way: the server and the load tests
build on the engine, and engine_core.cli takes their commands as arguments instead of importing them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from engine_core import cli as engine_cli


def add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model repository over HTTP/gRPC")
    try:  # the engine's commands keep working where the server's dependencies do not import
        from server.cli import add_serve_arguments
    except ImportError:
        p.add_argument("--model-repository", required=True)
    else:
        add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from server.cli import run_serve

    return run_serve(args)


def add_perf(sub: Any) -> None:
    p = sub.add_parser("perf", help="load-test a running server (like perf_analyzer); see `kiln perf --help`",
                       add_help=False)
    p.add_argument("perf_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_perf)


def cmd_perf(args: argparse.Namespace) -> int:
    from load_tests.perf import main as perf_main  # loaded only for `kiln perf`

    return perf_main(args.perf_args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["perf"]:  # `kiln perf` owns all its flags (argparse REMAINDER drops leading options)
        return cmd_perf(argparse.Namespace(perf_args=argv[1:]))
    return engine_cli.main(argv, commands=(add_serve, add_perf))


if __name__ == "__main__":
    sys.exit(main())
