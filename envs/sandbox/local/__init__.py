"""The local process sandbox: the embedded default, no daemon needed.

Each :class:`LocalSandbox` owns a temporary directory on the host::

    tokengym-sandbox-XXXX/      host-owned, mode 0711
        work/                   the workspace (read-write for the sandbox; a sized tmpfs as root)
        tmp/                    the sandbox's private /tmp (likewise)
        run/                    host-owned, read-only for the sandbox: python links, /etc/passwd, and
                                the snippets and shell scripts of running calls (0600, the sandbox uid's)

Every call starts a fresh child process in its own session and process group, with a clean
environment and resource limits (``prlimit``: CPU seconds, address space, processes, file
size, open files, no core files), and reads stdout and stderr through pipes with a cap
(the head is kept, the rest is counted and dropped: 100 MB of output never sits in memory).
At the wall-clock limit the whole process group is killed; after every call whatever the
command left running in the background is killed too.

**The sandbox as a whole.** Where the host lets this process create a cgroup (v2 delegated, or
the v1 ``memory`` and ``pids`` controllers as root), every call joins the sandbox's own cgroup
first, so ``memory_mb`` and ``max_processes`` count all of its processes together
(:mod:`.cgroups`); the workspace and ``/tmp`` are sized tmpfs mounts (disk and inode quota), or,
without the privilege to mount, a watchdog stops a call past the quota (:mod:`.quota`).
``close()`` removes every process, the cgroup, the mounts, any tree, and what the sandbox's own
uid left in the host's ``/tmp``, ``/var/tmp``, ``/dev/shm`` and System V IPC (:mod:`.leftovers`).
A host that is not root and has no working bubblewrap gets no unisolated sandbox unless it asks
for ``isolation="none"``.

**Isolation.** Where `bubblewrap <https://github.com/containers/bubblewrap>`_ works (checked by
a probe run, not by looking for the binary), each call runs inside new user, pid, network,
ipc, uts and cgroup namespaces: only a loopback interface, a read-only view of ``/usr`` (and
the interpreter's own prefix), a few files of ``/etc``, a private ``/tmp``, and the workspace
bound read-write at ``/workspace``. The rest of the host's files (the project, home
directories, ``/etc/shadow``) do not exist in there. ``--die-with-parent`` and the pid
namespace make every process of a call die with it. Without bubblewrap the same limits
apply, but the network and the host's files are **not** isolated; :attr:`isolation` says so.

**The user.** When the host runs as root, every sandbox runs as a uid of its own (a fresh,
otherwise unused uid per sandbox, or ``user=``): root is exempt from the process limit, so a
fork bomb run as root would not be stopped, and root could read every file. With a uid of
its own, ``RLIMIT_NPROC`` counts exactly that sandbox's processes, ``kill(-1)`` as that uid
reaps everything it left behind, however it daemonized, and host files that are not
world-readable stay unreadable even without bubblewrap.
"""


from .bwrap import BwrapStatus, find_bwrap
from .paths import INSIDE_UID, RUNDIR_INSIDE, TMP_PREFIX, WORKDIR_INSIDE
from .sandbox import IsolationMode, LocalSandbox, bwrap_status
from .uids import MARKER_VAR

__all__ = [
    "INSIDE_UID",
    "MARKER_VAR",
    "RUNDIR_INSIDE",
    "TMP_PREFIX",
    "WORKDIR_INSIDE",
    "BwrapStatus",
    "IsolationMode",
    "LocalSandbox",
    "bwrap_status",
    "find_bwrap",
]
