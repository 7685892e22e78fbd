"""`engram bench`: run the benchmark suite (`engram.benchmarks`) and print one table of ratios.

The suite, its runner and the table are `engram.apps.bench`'s; the benchmarks ship inside the
package, so this works from an installed wheel as from a source checkout. `--list` names them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from engram.apps.bench import SUITE, describe_suite, device_copy_gb_per_s, format_rows, run_suite
from engram.cli.options import input_folder

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add bench to the `engram` subparsers."""
    p = sub.add_parser("bench", help="run the benchmark suite (benchmarks/) and print one table of ratios")
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(SUITE)}")
    p.add_argument(
        "--quick", action="store_true", help="smaller sizes (the optimizer bench uses 16M rows, not 64M)"
    )
    p.add_argument(
        "--dir",
        type=input_folder,
        help="a folder of bench_*.py files to run instead (default: the installed engram.benchmarks)",
    )
    p.add_argument(
        "--list", action="store_true", help="name the benchmarks (each imported, not run) and exit"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.list:
        return _list(args)
    names = list(SUITE) if args.only is None else _selection(args.only)
    rows = run_suite(names, quick=args.quick, folder=args.dir)
    peak = device_copy_gb_per_s()
    if args.json:
        print(json.dumps({"rows": rows, "device_copy_gb_per_s": peak}, default=str))
    else:
        if peak is not None:
            print(f"device copy bandwidth (the peak GB/s is compared with): {peak:,.0f} GB/s")
        print("\n".join(format_rows(rows, peak)))
    return 0


def _selection(only: str) -> list[str]:
    """--only 'a,b' -> ['a', 'b']; an empty selection (or an empty name in it) is refused, not taken
    as the whole suite (unknown names are `run_suite`'s to refuse)."""
    names = [n.strip() for n in only.split(",")]
    if not all(names):
        raise ValueError(
            f"--only {only!r}: an empty benchmark name (nothing between commas); give a comma-separated subset of: "
            f"{', '.join(SUITE)} (or leave --only out to run them all)"
        )
    return names


def _list(args: argparse.Namespace) -> int:
    """0 when every benchmark imports, else 1 (the reason is printed)."""
    suite = describe_suite(args.dir)
    if args.json:
        print(json.dumps({"benchmarks": suite}))
    else:
        for d in suite:
            print(f"{d['name']:<12} {d['module']:<18} {d.get('summary') or 'NOT IMPORTABLE: ' + d['error']}")
    return 0 if all("error" not in d for d in suite) else 1
