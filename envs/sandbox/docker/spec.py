"""How a sandbox container is started: the hardened host config, and what is measured to be in effect."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..base import Isolation, Limits, SandboxError
from .engine import LABEL, OWNER_LABEL, docker_sdk, process_owner, docker_client

DEFAULT_IMAGE = "tokengym-sandbox:bookworm"
"""The sandbox image; ``TOKENGYM_SANDBOX_IMAGE`` overrides it."""
IMAGE_HELP = (
    "build it once with `bash .ci/sandbox-image.sh` from the tokengym repository (as root: a minimal "
    "Debian bookworm with python3 from debootstrap, imported with `docker import`; no registry needed), "
    "or pass image=... naming any local image that has /bin/sh, coreutils and python3"
)

WORKSPACE = "/workspace"
SANDBOX_USER = "1000:1000"
"""The user every command runs as (``sandbox`` in the image)."""
KEEPER_USER = "65534:65534"
"""The user of the container's own processes (init and ``sleep``): not the sandbox user, so a
command's ``kill -9 -1`` cannot stop the container."""
ENV = {
    "HOME": WORKSPACE,
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}


# ---------------------------------------------------------------------------------------------------
# One container


@dataclass
class Container:
    """A started container and what was measured about it."""

    id: str
    isolation: Isolation


def _swap_limited(client: Any) -> bool:
    info = getattr(client, "_tokengym_info", None)
    if info is None:
        try:
            info = client.api.info()
        except Exception:
            info = {}
        client._tokengym_info = info
    return bool(info.get("SwapLimit", True))


class Spec:
    """How to start a sandbox container (shared by a sandbox and the pool that makes it)."""

    def __init__(
        self,
        *,
        limits: Limits,
        image: str | None,
        runtime: str | None,
        cpus: float,
        workspace_mb: int | None,
        tmp_mb: int,
        env: Mapping[str, str] | None,
        labels: Mapping[str, str] | None,
        docker_host: str | None,
        client: Any,
    ) -> None:
        self.limits = limits
        self.image = image or os.environ.get("TOKENGYM_SANDBOX_IMAGE") or DEFAULT_IMAGE
        self.runtime = runtime
        self.cpus = cpus
        self.workspace_mb = limits.disk_mb if workspace_mb is None else workspace_mb
        self.tmp_mb = tmp_mb
        self.env = {**ENV, **(env or {})}
        self.labels = dict(labels or {})
        self.client = client or docker_client(docker_host)
        self.docker_host = docker_host or os.environ.get("DOCKER_HOST")
        """The engine as the docker CLI names it (None: its default socket)."""
        self._checked_image = False

    def check_image(self) -> None:
        if self._checked_image:
            return
        docker = docker_sdk()
        try:
            self.client.api.inspect_image(self.image)
        except docker.errors.ImageNotFound:
            raise SandboxError(f"the sandbox image {self.image!r} is not in the Docker engine: {IMAGE_HELP}") from None
        self._checked_image = True

    def start(self) -> Container:
        """Create, start and inspect one container; removed again if anything fails."""
        docker = docker_sdk()
        self.check_image()
        api = self.client.api
        lim = self.limits
        mem = f"{lim.memory_mb}m"
        host_config = api.create_host_config(
            network_mode="none",
            read_only=True,
            tmpfs={
                WORKSPACE: f"rw,exec,nosuid,nodev,size={self.workspace_mb}m,nr_inodes={lim.max_files},uid=1000,gid=1000,mode=0755",
                "/tmp": f"rw,nosuid,nodev,size={self.tmp_mb}m,nr_inodes={lim.max_files},mode=1777",
            },
            mem_limit=mem,
            memswap_limit=mem,
            pids_limit=lim.max_processes,
            nano_cpus=int(self.cpus * 1e9),
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            init=True,
            ulimits=[
                # soft < hard: SIGXCPU first (reported as the CPU limit), SIGKILL a second later.
                docker.types.Ulimit(name="cpu", soft=lim.cpu_s, hard=lim.cpu_s + 1),
                docker.types.Ulimit(name="fsize", soft=lim.max_file_mb << 20, hard=lim.max_file_mb << 20),
                docker.types.Ulimit(name="nofile", soft=lim.max_open_files, hard=lim.max_open_files),
                docker.types.Ulimit(name="core", soft=0, hard=0),
            ],
            shm_size="16m",
            log_config=docker.types.LogConfig(type="none"),
            runtime=self.runtime,
        )
        labels = {LABEL: "1", OWNER_LABEL: process_owner(), **self.labels}
        try:
            cid = api.create_container(
                self.image,
                command=["sleep", "infinity"],
                user=KEEPER_USER,
                working_dir=WORKSPACE,
                environment=self.env,
                hostname="sandbox",
                labels=labels,
                host_config=host_config,
            )["Id"]
        except docker.errors.ImageNotFound:
            self._checked_image = False
            raise SandboxError(f"the sandbox image {self.image!r} is not in the Docker engine: {IMAGE_HELP}") from None
        except docker.errors.APIError as e:
            raise SandboxError(f"the Docker engine refused the sandbox container: {e.explanation or e}") from e
        try:
            api.start(cid)
            info = api.inspect_container(cid)
            return Container(cid, self._measure(info))
        except BaseException as e:
            try:
                remove_container(self.client, cid)
            except Exception:
                pass
            if isinstance(e, docker.errors.APIError):
                raise SandboxError(f"the Docker engine could not start the sandbox container: {e.explanation or e}") from e
            raise

    def _measure(self, info: dict) -> Isolation:
        """What the engine says is in effect for this container (not what was asked for)."""
        hc = info.get("HostConfig") or {}
        cfg = info.get("Config") or {}
        if not (info.get("State") or {}).get("Running"):
            raise SandboxError(f"the sandbox container did not stay up: {info.get('State')}")
        network = hc.get("NetworkMode") == "none"
        mounts_from_host = [m for m in info.get("Mounts") or [] if m.get("Type") != "tmpfs"]
        filesystem = bool(hc.get("ReadonlyRootfs")) and not hc.get("Binds") and not mounts_from_host
        hardened = "ALL" in (hc.get("CapDrop") or []) and "no-new-privileges" in (hc.get("SecurityOpt") or [])
        limits = bool(hc.get("Memory")) and bool(hc.get("PidsLimit")) and bool(hc.get("NanoCpus")) and hardened
        tmpfs = hc.get("Tmpfs") or {}
        quota = all("size=" in (tmpfs.get(p) or "") and "nr_inodes=" in (tmpfs.get(p) or "") for p in (WORKSPACE, "/tmp"))
        details = [
            f"image {cfg.get('Image', self.image)}",
            f"runtime {hc.get('Runtime') or 'runc'}",
            f"user {SANDBOX_USER}",
            f"memory {hc.get('Memory', 0) >> 20} MB, pids {hc.get('PidsLimit')}, cpus {hc.get('NanoCpus', 0) / 1e9:g} "
            "(for the whole container)",
            f"disk quota: workspace {self.workspace_mb} MB, /tmp {self.tmp_mb} MB, {self.limits.max_files} files each (tmpfs)",
            "nothing outlives close(): the container, its tmpfs and its IPC namespace are removed",
        ]
        if not hardened:
            details.append("NOT hardened: capabilities or no-new-privileges missing")
        if not _swap_limited(self.client):
            details.append("the kernel does not limit swap")
        return Isolation(
            backend="docker",
            network=network,
            filesystem=filesystem,
            limits=limits,
            details=tuple(details),
            group_limits=limits,
            disk_quota=quota,
        )


def remove_container(client: Any, cid: str) -> None:
    docker = docker_sdk()
    try:
        client.api.remove_container(cid, force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if e.status_code != 409:  # removal already in progress
            raise
