"""Entry point of the ``weightsync`` command.

The CLI is the composition root: each command lives in its own module under
``weightsync.cli`` and imports the heavy components (torch, vLLM, the trainer, the
operator) only when it runs, so ``weightsync --help`` is instant and the operator
image never needs torch. Every option can also come from a ``WEIGHTSYNC_*``
environment variable (e.g. ``--model`` from ``WEIGHTSYNC_MODEL``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# command name -> module with `add_arguments(parser)` and `run(args) -> int`
COMMANDS: dict[str, str] = {
    "models": "weightsync.cli.models",
    "crds": "weightsync.cli.crds",
    "operator": "weightsync.cli.operator",
    "sandbox": "weightsync.cli.sandbox",
    "coordinator": "weightsync.cli.coordinator",
    "proxy": "weightsync.cli.proxy",
    "agent": "weightsync.cli.agent",
    "demo": "weightsync.cli.demo",
    "run": "weightsync.cli.run",
}

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _EnvDefaults(argparse.ArgumentParser):
    """An ArgumentParser whose options default to ``WEIGHTSYNC_<OPTION>`` when set."""

    def _add_action(self, action: argparse.Action) -> argparse.Action:  # type: ignore[override]
        if action.option_strings and action.dest not in ("help",):
            env = "WEIGHTSYNC_" + action.dest.upper()
            if env in os.environ:
                value = os.environ[env]
                if isinstance(action, argparse._StoreTrueAction):
                    action.default = value.lower() in ("1", "true", "yes")
                elif action.type is not None and callable(action.type):
                    action.default = action.type(value)
                else:
                    action.default = value
                action.required = False
            if action.help and action.help is not argparse.SUPPRESS:
                action.help += f" [env: {env}]"
        return super()._add_action(action)


def build_parser() -> argparse.ArgumentParser:
    parser = _EnvDefaults(
        prog="weightsync",
        description="Move RL policy weights from a trainer into vLLM replicas: fast, verified, visible.",
    )
    from weightsync import __version__

    parser.add_argument("--version", action="version", version=f"weightsync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_EnvDefaults)
    for name, module_path in COMMANDS.items():
        module = importlib.import_module(module_path)
        doc = (module.__doc__ or "").strip()
        summary = doc.splitlines()[0] if doc else name
        p = sub.add_parser(name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        code: int = args._module.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
