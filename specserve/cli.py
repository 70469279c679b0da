"""Command line: ``specserve models list|pull`` (and, later, ``specserve generate``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import models
from .models import ModelError, UnknownModelError

EXIT_OK = 0
EXIT_ERROR = 1  # a model error: download, integrity, conversion ...
EXIT_USAGE = 2  # bad arguments, unknown model names (argparse uses 2 as well)
EXIT_INTERRUPTED = 130


# --------------------------------------------------------------------------- models


def _cmd_models_list(args: argparse.Namespace) -> int:
    rows = models.list_models()
    table = [("NAME", "CACHED", "SIZE", "DESCRIPTION")]
    for r in rows:
        table.append(
            (r["name"], "yes" if r["cached"] else "no", models._human(r["size_bytes"]), r["description"])
        )
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
    print(f"\ncache: {models.specserve_home() / 'models'}  (set SPECSERVE_HOME to move it)")
    return EXIT_OK


def _cmd_models_pull(args: argparse.Namespace) -> int:
    for name in args.names:  # validate every name before downloading anything
        models.get_spec(name)
    for name in args.names:
        models.pull(name, force=args.force, log=lambda msg: print(msg, flush=True))
    return EXIT_OK


def add_models_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="list and download the registry models")
    msub = p.add_subparsers(dest="models_command", metavar="{list,pull}", required=True)

    p_list = msub.add_parser("list", help="show the registry models and whether they are cached")
    p_list.set_defaults(func=_cmd_models_list)

    p_pull = msub.add_parser("pull", help="download, verify and convert registry models")
    p_pull.add_argument("names", nargs="+", metavar="NAME", help="registry model name(s)")
    p_pull.add_argument("--force", action="store_true", help="pull again even when already cached")
    p_pull.set_defaults(func=_cmd_models_pull)


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve", description="Exact speculative decoding for LLMs, served on Ray Serve."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_models_parser(subparsers)
    # ------------------------------------------------------------------ generate (TODO)
    # The `generate` subcommand goes here: define `add_generate_parser(subparsers)` in this
    # module (it must `set_defaults(func=<handler returning an exit code>)`) and call it:
    #     add_generate_parser(subparsers)
    # main() already turns ModelError into a clean message and exit code.
    # ------------------------------------------------------------------------------------
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or EXIT_OK)
    except UnknownModelError as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModelError as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("specserve: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
