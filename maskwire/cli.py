"""The `maskwire` command: one subcommand per service plus local tooling.

Each subcommand lives in a light module exposing `add_arguments(parser)` and `run(args) -> int`,
so `maskwire --help` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from maskwire.lifeline import hold_on

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "grammar-service": ("grammar_service.cli", "run the gRPC grammar service (CPU)"),
    "worker": ("neuron_worker.cli", "run the device worker (model + sampler)"),
    "gateway": ("gateway.cli", "run the OpenAI-compatible REST gateway"),
    "up": ("maskwire.up", "run grammar service, worker and gateway locally"),
    "generate": ("maskwire.generate", "send one Generate request and print the answer"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maskwire", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    hold_on()  # end with `maskwire up` when it started this process
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
