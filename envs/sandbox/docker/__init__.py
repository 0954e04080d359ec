"""The Docker sandbox: one hardened container per sandbox, a warm pool, and orphan cleanup.

Each :class:`DockerSandbox` is a container started from a small local image (default
``tokengym-sandbox:bookworm``, built without any registry by ``.ci/sandbox-image.sh``) with

* network mode ``none`` (only ``lo``), a read-only root file system and tmpfs mounts for the
  workspace (``/workspace``) and ``/tmp`` -- nothing of the host is mounted;
* memory = memory+swap (no swap), a pids limit, a CPU quota, rlimits for CPU seconds, file size
  and open files;
* all capabilities dropped, ``no-new-privileges``, an init (``init=True``: orphans are reaped, so
  zombies never eat the pids limit), and unprivileged users: the container's keeper process runs as
  ``nobody`` and every command as the ``sandbox`` user (1000), which therefore cannot kill the
  keeper;
* optionally another OCI runtime (``runtime="runsc"`` for gVisor).

Every command runs through a small wrapper inside the container: ``timeout -s KILL`` enforces the
wall-clock limit there, and afterwards ``kill -9 -1`` (as the sandbox user) removes whatever the
command left running in the background; the wrapper reports the exit code and the memory cgroup's
OOM-kill counter on stderr, so a result says ``timeout``, ``oom`` or ``killed`` honestly. A
client-side watchdog covers the case where the engine itself stops answering: the call returns at
the deadline and the container is replaced. Output is read as it comes and cut to
:attr:`Limits.max_output_bytes` (the rest is counted and dropped), so a flood never fills memory.
Calls on one sandbox take turns. ``write_file``/``read_file`` go through the same exec (the
workspace is a tmpfs, which ``docker cp`` cannot reach) and never follow a symlink.

Containers carry the label ``org.tokengym.sandbox`` and their owner (host, pid, process start
time); :func:`cleanup_containers` removes those whose owner is gone (a crash, SIGKILL). A sandbox
is removed by ``close()``, at the end of a ``with`` block, when it is garbage-collected and at
interpreter exit (pools too).

:class:`DockerPool` keeps N containers started and ready; ``pool.acquire()`` (or ``pool()``, so a
pool is a ``sandbox_factory``) hands one out at once, and closing that sandbox gives it back: the
pool replaces it with a fresh container (``recycle="fresh"``, the default) or wipes its workspace
(``recycle="wipe"``), in the background, so an episode never waits for a container start.
"""

from .engine import LABEL, OWNER_LABEL, POOL_LABEL, process_owner, cleanup_containers, docker_client
from .framing import GRACE_S
from .pool import DockerPool
from .sandbox import DockerSandbox
from .spec import DEFAULT_IMAGE, SANDBOX_USER, WORKSPACE

__all__ = [
    "DEFAULT_IMAGE",
    "GRACE_S",
    "LABEL",
    "OWNER_LABEL",
    "POOL_LABEL",
    "SANDBOX_USER",
    "WORKSPACE",
    "DockerPool",
    "DockerSandbox",
    "process_owner",
    "cleanup_containers",
    "docker_client",
]
