"""The warm pool of sandbox containers."""

from __future__ import annotations

import atexit
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

from ..base import Limits, SandboxError, resolve_limits
from .engine import POOL_LABEL, cleanup_containers
from .sandbox import DockerSandbox
from .spec import Container, remove_container, Spec


_LIVE: weakref.WeakSet = weakref.WeakSet()
"""Pools still open (closed at interpreter exit)."""


# ---------------------------------------------------------------------------------------------------
# The warm pool


class DockerPool:
    """Keeps ``size`` sandbox containers started and ready, so an episode never waits for one.

    ``pool.acquire()`` (or ``pool()``: a pool is a ``sandbox_factory``) returns a
    :class:`DockerSandbox` at once when one is ready (a *hit*) and starts one when none is (a
    *miss*, counted in :attr:`stats`). Closing that sandbox gives the container back; the pool then,
    in the background, removes it and starts a fresh one (``recycle="fresh"``) or wipes its
    workspace and ``/tmp`` and kills its processes (``recycle="wipe"``, cheaper). Either way the
    next episode never sees the previous one's files or processes. ``close()`` (or leaving a
    ``with`` block) removes every container of the pool, ready or handed out.

    Keyword arguments other than ``size``, ``recycle`` and ``workers`` are those of
    :class:`DockerSandbox`. Orphaned sandbox containers of crashed processes are removed when a
    pool starts (``cleanup_orphans=False`` to keep them).
    """

    def __init__(
        self,
        size: int = 4,
        limits: Limits | None = None,
        *,
        recycle: Literal["fresh", "wipe"] = "fresh",
        workers: int = 4,
        cleanup_orphans: bool = True,
        image: str | None = None,
        runtime: str | None = None,
        cpus: float = 1.0,
        workspace_mb: int | None = None,
        tmp_mb: int = 64,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        docker_host: str | None = None,
        client: Any = None,
        **limit_overrides: Any,
    ) -> None:
        if size < 0:
            raise ValueError("size must be >= 0")
        if recycle not in ("fresh", "wipe"):
            raise ValueError('recycle must be "fresh" or "wipe"')
        self.size = size
        self.recycle = recycle
        self.id = secrets.token_hex(4)
        self._spec = Spec(
            limits=resolve_limits(limits, limit_overrides, "DockerPool"),
            image=image,
            runtime=runtime,
            cpus=cpus,
            workspace_mb=workspace_mb,
            tmp_mb=tmp_mb,
            env=env,
            labels={**(labels or {}), POOL_LABEL: self.id},
            docker_host=docker_host,
            client=client,
        )
        self.limits = self._spec.limits
        self._spec.check_image()
        if cleanup_orphans:
            cleanup_containers(client=self._spec.client)
        self._cond = threading.Condition()
        self._ready: deque[Container] = deque()
        self._pending = 0  # starts (and wipes) in flight
        self._leased: weakref.WeakSet[DockerSandbox] = weakref.WeakSet()
        self._closed = False
        self._errors = 0
        self.last_error: str | None = None
        self.stats = {"hits": 0, "misses": 0, "started": 0, "recycled": 0, "removed": 0}
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        self._executor = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tokengym-docker-pool")
        _LIVE.add(self)
        self._refill()

    # --- background work ---------------------------------------------------------------------------

    def _refill(self) -> None:
        with self._cond:
            if self._closed:
                return
            missing = self.size - len(self._ready) - self._pending
            # Back off after repeated failures (a broken engine): the misses will say why.
            if self._errors >= 3:
                missing = 0
            for _ in range(max(0, missing)):
                self._pending += 1
                self._executor.submit(self._start_one)

    def _start_one(self) -> None:
        try:
            container = self._spec.start()
        except Exception as e:
            with self._cond:
                self._pending -= 1
                self._errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self._cond.notify_all()
            return
        with self._cond:
            self._pending -= 1
            self._errors = 0
            self.stats["started"] += 1
            if self._closed:
                keep = False
            else:
                self._ready.append(container)
                keep = True
            self._cond.notify_all()
        if not keep:
            self._remove(container.id)

    def _remove(self, cid: str) -> None:
        try:
            remove_container(self._spec.client, cid)
            with self._cond:
                self.stats["removed"] += 1
        except Exception:
            pass

    def _give_back(self, container: Container) -> bool:
        """Called by a pooled sandbox's close(); False when the pool is closed (remove it then)."""
        with self._cond:
            if self._closed:
                return False
            self.stats["recycled"] += 1
            if self.recycle == "wipe":
                self._pending += 1
            try:
                self._executor.submit(self._recycle, container)
            except RuntimeError:  # the executor is shut down
                if self.recycle == "wipe":
                    self._pending -= 1
                return False
        return True

    def _recycle(self, container: Container) -> None:
        if self.recycle == "fresh":
            self._remove(container.id)
            self._refill()
            return
        ok = False
        try:
            sb = DockerSandbox(_spec=self._spec, _container=container)
            sb._finalizer.detach()
            ok = sb._wipe()
            sb._closed = True
        except Exception:
            ok = False
        with self._cond:
            self._pending -= 1
            keep = ok and not self._closed
            if keep:
                self._ready.append(container)
            self._cond.notify_all()
        if not keep:
            self._remove(container.id)
            self._refill()

    # --- the public side ---------------------------------------------------------------------------

    @property
    def ready(self) -> int:
        """Containers started and waiting."""
        with self._cond:
            return len(self._ready)

    def wait_ready(self, n: int | None = None, timeout_s: float = 60.0) -> bool:
        """Block until ``n`` (default: ``size``) containers are ready; False on timeout."""
        n = self.size if n is None else n
        end = time.monotonic() + timeout_s
        with self._cond:
            while len(self._ready) < n:
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cond.wait(left)
            return True

    def acquire(self) -> DockerSandbox:
        """A sandbox for one episode: a ready container at once, or a freshly started one."""
        with self._cond:
            if self._closed:
                raise SandboxError("the pool is closed")
            container = self._ready.popleft() if self._ready else None
            self.stats["hits" if container else "misses"] += 1
        self._refill()
        if container is None:
            container = self._spec.start()
            with self._cond:
                self.stats["started"] += 1
                restart = self._errors >= 3
                self._errors = 0  # the engine works again: let the background refill resume
            if restart:
                self._refill()
        sb = DockerSandbox(_spec=self._spec, _container=container, _pool=self)
        with self._cond:
            self._leased.add(sb)
        return sb

    def __call__(self, *args: Any, **kwargs: Any) -> DockerSandbox:
        """``sandbox_factory`` form of :meth:`acquire` (arguments are ignored: the pool's settings hold)."""
        return self.acquire()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed pool hands out no sandbox."""
        return self._closed

    def close(self) -> None:
        """Remove every container of the pool: the ready ones and those handed out. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            ready = list(self._ready)
            self._ready.clear()
            leased = list(self._leased)
            self._cond.notify_all()
        _LIVE.discard(self)
        for sb in leased:
            sb.close()  # the pool is closed, so this removes the container
        self._executor.shutdown(wait=True)
        for c in ready:
            self._remove(c.id)
        # Anything a worker started while closing (it removes its own), and stragglers by label.
        try:
            for c in self._spec.client.api.containers(all=True, filters={"label": f"{POOL_LABEL}={self.id}"}):
                self._remove(c["Id"])
        except Exception:
            pass

    def __enter__(self) -> DockerPool:
        return self

    def __copy__(self) -> DockerPool:
        return self

    def __deepcopy__(self, memo: dict) -> DockerPool:
        # A pool is a handle on shared containers (e.g. in an env spec's kwargs, which gymnasium's
        # wrappers deep-copy): copies are the same pool.
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DockerPool size={self.size} ready={self.ready} recycle={self.recycle} image={self._spec.image}>"


@atexit.register
def _close_all() -> None:
    for obj in list(_LIVE):
        try:
            obj.close()
        except Exception:
            pass
