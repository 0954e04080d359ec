"""``tokengym view DIR``: serve the viewer of :mod:`tokengym.recorder.viewer` on 127.0.0.1 until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_view_parser", "cmd_view"]


def add_view_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``view`` sub-command to ``parser.add_subparsers(...)``; returns its parser."""
    p = subparsers.add_parser(
        "view",
        help="browse the runs in a store folder in a local web page",
        description=(
            "Serve a page on 127.0.0.1 (a free port unless --port; the address is printed) over the trajectory "
            "stores in DIR: their episodes filtered by reward, finish reason, conformance, task and group, one "
            "episode's tokens with the policy's shaded by logprob, and two episodes of a group side by side. "
            "Nothing is fetched from the network. Ctrl-C stops it."
        ),
        epilog="exit codes: 0 stopped by Ctrl-C; 2 DIR holds no readable store, or the port is taken",
    )
    p.add_argument("path", metavar="DIR", help="a store, or a folder with stores in it (up to 3 levels down)")
    p.add_argument("--port", type=int, default=0, help="the port on 127.0.0.1 (0: a free one)")
    p.add_argument("--tokenizer", help="for decoding: local folder, pinned name or hub name (default: each store's "
                   "tokenizer when it is a pinned or packaged name)")
    p.add_argument("--log-requests", action="store_true", help="print each request")
    p.set_defaults(func=cmd_view)
    return p


def cmd_view(args: argparse.Namespace) -> int:
    """Run ``tokengym view``; returns when stopped (Ctrl-C: 0) or refused (2, the reason on stderr)."""
    from ..store import StoreError
    from ..viewer import Viewer, ViewerServer

    try:
        viewer = Viewer(args.path, tokenizer=args.tokenizer)
        episodes = sum(len(run.index()) for run in viewer.runs.values())
        server = ViewerServer(viewer, args.port, log_requests=args.log_requests)
    except (StoreError, OSError, ValueError) as err:
        print(f"tokengym view: error: {err}", file=sys.stderr)
        return 2
    runs = len(viewer.runs)
    print(f"tokengym view: {runs} run{'s' if runs != 1 else ''}, {episodes:,} episodes in {args.path}", flush=True)
    print(f"serving at {server.url}  (127.0.0.1 only; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("\nstopped", flush=True)
    finally:
        server.server_close()
    return 0
