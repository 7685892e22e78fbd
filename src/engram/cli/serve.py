"""`engram serve FOLDER`: serve a folder written by engram.hf with vLLM's OpenAI-compatible server.

The settings (dtype, KV cache, window) are `engram.vllm.server.plan_server`'s, printed before the
server starts with the reason for each; `--patch` (repeatable) writes memory patches into the served
tables at load. engram serve's own options come before FOLDER; everything after FOLDER goes to
vLLM's server unchanged (and wins over the settings chosen). Needs vLLM in this Python (the
plugin's environment): without it, one line saying so, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from typing import Any

from engram.cli.options import input_folder
from engram.cli.stopping import Stopped
from engram.vllm.server import DTYPES, plan_server, vllm_missing

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add serve to the `engram` subparsers."""
    p = sub.add_parser(
        "serve",
        help="serve an engram.hf folder with vLLM's OpenAI-compatible server (settings that fit this machine)",
        description="Start vLLM's OpenAI-compatible server (python -m vllm.entrypoints.openai.api_server) for "
        "FOLDER with settings chosen for it and this machine, printed first. Options of engram serve come "
        "before FOLDER; arguments after FOLDER go to vLLM's server unchanged, e.g. engram serve --port 8001 "
        "served --max-num-seqs 16.",
    )
    p.add_argument(
        "folder", type=input_folder, help="the folder: model.save_pretrained + engram.hf.save_engram"
    )
    p.add_argument("--port", type=int, default=8000, help="the server's port (default 8000)")
    p.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="float32 (default: greedy tokens equal HF's)"
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        help="GiB of KV cache on the CPU (default: $VLLM_CPU_KVCACHE_SPACE, else a quarter of the free memory)",
    )
    p.add_argument(
        "--patch",
        action="append",
        default=[],
        metavar="FILE",
        help="a memory patch (engram.memory: facts written into Engram rows) applied to the served tables at "
        "load; repeat for more, applied in order (tables 'memory', the default, or 'host')",
    )
    p.add_argument("--dry-run", action="store_true", help="print the settings and the command; start nothing")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="vLLM server arguments, passed unchanged")
    p.set_defaults(func=cmd_serve)


OWN = ("--kv-cache-gib", "--patch", "--dry-run")  # engram serve's options that vLLM's server does not take


def cmd_serve(args: argparse.Namespace) -> int:
    extra = list(args.vllm_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    own = [a for a in extra if a.split("=")[0] in OWN]
    if own:
        raise ValueError(
            f"{own[0]} comes after FOLDER, where arguments go to vLLM's server: put engram serve's own options "
            f"({', '.join(OWN)}) before FOLDER"
        )
    missing = None if args.dry_run else vllm_missing()
    if missing is not None:
        raise ValueError(missing)
    plan = plan_server(
        args.folder,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        port=args.port,
        extra=extra,
        patches=args.patch,
    )
    for note in plan.notes:
        print(f"engram serve: {note}", file=sys.stderr)
    # quoted where a shell needs it (the patches' JSON list): the line can be copied
    shown = " ".join([*(f"{k}={v}" for k, v in plan.env.items()), "python", shlex.join(plan.argv[1:])])
    print(f"engram serve: {shown}", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    server = subprocess.Popen(plan.argv, env={**os.environ, **plan.env})
    try:
        status = server.wait()
    except KeyboardInterrupt as e:
        status = _stop_server(server, e)
    return status if status >= 0 else 128 - status  # a server ended by a signal: the shells' 128 + N


STOP_GRACE_S = 30.0  # how long a stopped server may take to shut down before it is killed


def _stop_server(server: subprocess.Popen, e: KeyboardInterrupt) -> int:
    """Stop vLLM's server after engram serve was stopped, then return its exit status. Ctrl-C reached
    the server too (one process group); SIGTERM was sent to engram serve alone, so it is passed on (a
    server left running would hold the port with no parent). A server still running after
    `STOP_GRACE_S`, or a second Ctrl-C / SIGTERM, kills it: the command always ends."""
    if isinstance(e, Stopped):
        server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=STOP_GRACE_S)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        server.kill()
        return server.wait()
