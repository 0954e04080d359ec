"""The Docker engine client (one per engine, one connection pool), container owners and orphan cleanup."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from ..base import SandboxError, process_start_time

LABEL = "org.tokengym.sandbox"
"""Every container this module starts carries this label (value ``"1"``)."""
OWNER_LABEL = "org.tokengym.sandbox.owner"
"""``host:pid:start-time`` of the process that started the container."""
POOL_LABEL = "org.tokengym.sandbox.pool"

API_TIMEOUT_S = 30
"""Timeout of one Docker API request (create, start, remove...)."""

def docker_sdk() -> Any:
    try:
        import docker  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            'the Docker sandbox needs the docker SDK: pip install "tokengym[docker]"'
        ) from e
    return docker


_CLIENTS: dict[str, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def docker_client(docker_host: str | None = None) -> Any:
    """A shared ``docker.DockerClient`` for ``docker_host`` (default: ``DOCKER_HOST`` or the default
    socket), checked to answer; :class:`SandboxError` with a clear reason when no engine does."""
    docker = docker_sdk()
    key = docker_host or os.environ.get("DOCKER_HOST") or ""
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is not None:
            return client
        where = key or "the default socket (unix:///var/run/docker.sock)"
        try:
            if docker_host:
                client = docker.DockerClient(base_url=docker_host, timeout=API_TIMEOUT_S, max_pool_size=64)
            else:
                client = docker.from_env(timeout=API_TIMEOUT_S, max_pool_size=64)
            _one_connection_pool(client)
            client.ping()
        except Exception as e:
            raise SandboxError(
                f"no Docker engine answers at {where}: {type(e).__name__}: {e}. Start one (as root, "
                "`bash .ci/docker-up.sh` starts a private engine and prints its DOCKER_HOST) or set DOCKER_HOST"
            ) from e
        _CLIENTS[key] = client
    _reclaim_at_first_use(client, where)
    return client


def _reclaim_at_first_use(client: Any, where: str) -> None:
    """The containers of dead owners go when this process first reaches an engine (a SIGKILL runs
    no finalizer: its containers would outlive it); what is removed is logged, a failure warned."""
    try:
        removed = cleanup_containers(client=client)
    except Exception as err:  # noqa: BLE001 -- the engine answered; the sandbox can still start
        import warnings  # noqa: PLC0415

        warnings.warn(f"could not remove the sandbox containers of dead owners at {where}: {err}", RuntimeWarning, stacklevel=3)
        return
    if removed:
        logging.getLogger("tokengym.sandbox").warning(
            "removed %d sandbox container(s) of dead owners at %s", len(removed), where
        )


def _one_connection_pool(client: Any) -> None:
    """Let a Unix-socket client keep one connection pool instead of one per URL.

    The SDK's Unix adapter keys its pools by the whole URL, and every container and exec has URLs
    of its own: with many sandboxes that is 25 pools (its cap) of idle sockets, each holding as
    many as there were concurrent requests. All of them go to the same socket, so one pool does.
    """
    try:
        from docker.transport.unixconn import UnixHTTPAdapter  # noqa: PLC0415
    except ImportError:  # pragma: no cover - another SDK layout: keep its behaviour
        return
    for adapter in client.api.adapters.values():
        if isinstance(adapter, UnixHTTPAdapter):
            get = adapter.get_connection
            adapter.get_connection = lambda url, proxies=None, _get=get: _get("http+docker://localhost", proxies)


_OWNERS: dict[int, str] = {}


def process_owner() -> str:
    """This process's owner label (computed per pid: a forked child is an owner of its own)."""
    pid = os.getpid()
    if pid not in _OWNERS:
        _OWNERS[pid] = f"{socket.gethostname()}:{pid}:{process_start_time(pid) or 0}"
    return _OWNERS[pid]


def owner_alive(owner: str) -> bool:
    """Whether the process that an owner label names is still running (on this host)."""
    try:
        host, pid, start = owner.rsplit(":", 2)
    except ValueError:
        return False
    if host != socket.gethostname():
        return True  # another machine's: never ours to judge
    return process_start_time(int(pid)) == start


def cleanup_containers(
    *, all: bool = False, client: Any = None, docker_host: str | None = None
) -> list[str]:
    """Remove sandbox containers (label :data:`LABEL`) left behind by a crashed process.

    By default only those whose owner process (on this host) is gone; ``all=True`` removes every
    sandbox container of the engine, including live ones of other processes. Returns the removed ids.
    """
    docker = docker_sdk()
    client = client or docker_client(docker_host)
    removed = []
    for c in client.api.containers(all=True, filters={"label": f"{LABEL}=1"}):
        owner = (c.get("Labels") or {}).get(OWNER_LABEL, "")
        if not all and (owner == process_owner() or owner_alive(owner)):
            continue
        try:
            client.api.remove_container(c["Id"], force=True)
            removed.append(c["Id"])
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if e.status_code != 409:  # 409: removal already in progress
                raise
    return removed
