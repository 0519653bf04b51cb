"""The ``longstraw`` command line. Each subcommand lives in a small function; heavy imports happen inside it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_envs(args: argparse.Namespace) -> int:
    from longstraw_agents.envs import registered_env_ids

    for env_id in registered_env_ids():
        print(env_id)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from longstraw_agents.store import Store, StoreError

    try:
        with Store.open(args.db, create=False) as store:
            report = store.summary_text(
                episode=args.episode,
                group=args.group,
                transcript=args.transcript,
                where=args.where,
                max_text=args.max_text,
            )
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longstraw", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("envs", help="list the registered LongStraw environments")
    p.set_defaults(func=_cmd_envs)

    p = sub.add_parser("inspect", help="summarise a trajectory store (SQLite)")
    p.add_argument("db", help="path to a store written by longstraw")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--episode", type=int, default=None, help="show one episode's transcript")
    shown.add_argument("--group", default=None, help="show the transcripts of one group")
    p.add_argument("--transcript", action="store_true", help="print transcripts of all shown episodes")
    p.add_argument(
        "--where", default=None, help='SQL condition on the episodes table, e.g. "reward > 0 AND policy_version >= 3"'
    )
    p.add_argument("--max-text", type=int, default=120, help="cut segment text to this many characters (0: never)")
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
