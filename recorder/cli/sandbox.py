"""``tokengym sandbox gc`` and ``tokengym sandbox list``: the sandboxes on this machine, and the
removal of those a killed run left (a SIGKILL runs no ``close()``). Every sandbox start does the
same reclaim once per process; the command is for a machine where no run starts next."""

from __future__ import annotations

import argparse
import os
from typing import Any

EXIT_LEFT_OVER = 1
"""Something of a dead owner could not be removed (the message names it)."""


def add_sandbox_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sandbox", help="list the sandboxes on this machine, or remove those of killed runs",
        description="Local sandboxes: each keeps a lock on an owner record in its folder for its whole life; "
        "`gc` removes the processes, cgroups, tmpfs mounts and folders of those whose lock is free (a dead "
        "owner) and never a live run's. Docker sandboxes: the containers whose owner process is gone.",
        epilog=f"exit codes: 0 done; {EXIT_LEFT_OVER} something of a dead owner could not be removed (named); 2 bad input",
    )
    p.add_argument("action", choices=["gc", "list"], help="gc: remove what dead owners left; list: show every sandbox")
    p.add_argument(
        "--tmp-dir", action="append", default=[], metavar="DIR",
        help="where local sandboxes are made (their tmp_root; default: the system temp directory); repeatable",
    )
    p.add_argument("--docker", choices=["auto", "yes", "no"], default="auto",
                   help="containers too: auto when the docker SDK is installed and an engine answers; yes: it must")
    p.add_argument("--docker-host", help="the engine (default DOCKER_HOST or the default socket)")
    p.set_defaults(func=cmd_sandbox)
    return p


def _docker(args: argparse.Namespace, gc: bool) -> tuple[str, bool]:
    """One line on the Docker engine's sandbox containers, and whether it is a failure."""
    if args.docker == "no":
        return "", False
    from tokengym.envs.sandbox.base import SandboxError

    try:
        from tokengym.envs.sandbox.docker.engine import LABEL, OWNER_LABEL, owner_alive, cleanup_containers, docker_client

        client = docker_client(args.docker_host)
    except (ImportError, SandboxError) as err:
        if args.docker == "yes":
            return f"docker: {err}", True
        return f"docker: skipped ({str(err).split('.')[0]})", False
    if gc:
        removed = cleanup_containers(client=client)
        return f"docker: removed {len(removed)} container(s) of dead owners", False
    rows = client.api.containers(all=True, filters={"label": f"{LABEL}=1"})
    lines = []
    for c in rows:
        owner = (c.get("Labels") or {}).get(OWNER_LABEL, "")
        state = "live" if owner_alive(owner) else "DEAD OWNER"
        lines.append(f"  {c['Id'][:12]} {c.get('State', '')} owner {owner or '?'} ({state})")
    return "\n".join([f"docker: {len(rows)} sandbox container(s)", *lines]), False


def cmd_sandbox(args: argparse.Namespace) -> int:
    from tokengym.envs.sandbox.local.reclaim import reclaim, scan

    dirs = [os.path.abspath(d) for d in args.tmp_dir] or None
    for d in dirs or []:
        if not os.path.isdir(d):
            raise ValueError(f"--tmp-dir {d}: no such folder")
    failed = False
    if args.action == "gc":
        done = reclaim(dirs)
        print(f"local: {done.summary()}")
        failed = bool(done.problems)
    else:
        owners = scan(dirs)
        print(f"local: {len(owners)} sandbox folder(s)")
        for o in owners:
            state = "live" if o.alive else "DEAD OWNER (tokengym sandbox gc removes it)"
            who = f"pid {o.pid}" if o.pid is not None else "owner ?"
            print(f"  {o.root} {who} ({state}{'; ' + o.note if o.note else ''})")
    line, docker_failed = _docker(args, args.action == "gc")
    if line:
        print(line)
    return EXIT_LEFT_OVER if failed or docker_failed else 0
