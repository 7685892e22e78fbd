"""`engram bench`: run the benchmark suite (`engram.benchmarks`) and print one table of ratios.

The suite, its runner and the table are `engram.apps.tools.bench`'s; the benchmarks ship inside the
package, so this works from an installed wheel as from a source checkout. `--list` names them. A name
`--only` gives that is not a benchmark is refused (exit 2); a benchmark it names that cannot run on this
machine (no CUDA, no vLLM) is reported in its row and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engram.apps.tools.bench import (
    SUITE,
    check_names,
    describe_suite,
    device_copy_gb_per_s,
    format_rows,
    run_suite,
)
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
    """0 when every benchmark asked for ran; 1 when one named with --only could not run here (its
    row says why; the whole suite skips what this machine cannot run and still exits 0)."""
    names = None if args.only is None else _selection(args.only)  # unknown names: refused, exit 2
    if args.list:
        return _list(args, names)
    rows = run_suite(names or list(SUITE), quick=args.quick, folder=args.dir)
    peak = device_copy_gb_per_s()
    if args.json:
        print(json.dumps({"rows": rows, "device_copy_gb_per_s": peak}, default=str))
    else:
        if peak is not None:
            print(f"device copy bandwidth (the peak GB/s is compared with): {peak:,.0f} GB/s")
        print("\n".join(format_rows(rows, peak)))
    skipped = [r["bench"] for r in rows if r.get("skipped")]
    if names is not None and skipped:
        print(
            f"engram bench: error: --only {args.only}: {', '.join(skipped)} could not run on this machine "
            "(see the skipped row for why)",
            file=sys.stderr,
        )
        return 1
    return 0


def _selection(only: str) -> list[str]:
    """--only 'a,b' -> ['a', 'b']; an empty selection (or an empty name in it) is refused, not taken
    as the whole suite, and so is a name that is not a benchmark (naming the known ones)."""
    names = [n.strip() for n in only.split(",")]
    if not all(names):
        raise ValueError(
            f"--only {only!r}: an empty benchmark name (nothing between commas); give a comma-separated subset of: "
            f"{', '.join(SUITE)} (or leave --only out to run them all)"
        )
    try:
        check_names(names)
    except ValueError as e:
        raise ValueError(f"--only {only}: {e}") from None
    return names


def _list(args: argparse.Namespace, names: list[str] | None) -> int:
    """0 when every benchmark listed imports, else 1 (the reason is printed)."""
    suite = describe_suite(args.dir, names)
    if args.json:
        print(json.dumps({"benchmarks": suite}))
    else:
        for d in suite:
            print(f"{d['name']:<12} {d['module']:<18} {d.get('summary') or 'NOT IMPORTABLE: ' + d['error']}")
    return 0 if all("error" not in d for d in suite) else 1
