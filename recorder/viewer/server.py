"""The viewer's local web server: the page, and a small JSON API over the runs' indexes.

Bound to 127.0.0.1 only, on a free port unless one is asked for. It answers only requests
whose ``Host`` is that address (a web page elsewhere cannot reach it through a DNS name that
points here), sends a Content-Security-Policy that allows nothing but its own script, style
and images (a store is data from elsewhere: no text in it can run), and fetches nothing from
the network. The page builds every element from text, never from HTML.
"""

from __future__ import annotations

import functools
import io
import json
import math
import threading
from collections import OrderedDict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..store import StoreError
from ..trajectory import Trajectory
from .catalog import EpisodeFilter, Run, find_runs
from .episode import WINDOW, episode_json, read_episode

__all__ = ["PAGE_SIZE", "Viewer", "ViewerServer"]

PAGE_SIZE = 50
"""Episodes in a page of the list (a request may ask for up to 500)."""

_STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
           "/app.css": ("app.css", "text/css; charset=utf-8")}
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class ApiError(Exception):
    """An answer other than 200, with the message the page shows."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@functools.lru_cache(maxsize=8)
def _tokenizer(spec: str) -> Any:
    from tokengym.envs import load_tokenizer

    return load_tokenizer(spec)


class Viewer:
    """The runs under a folder and what the API answers about them (no HTTP here: testable alone)."""

    def __init__(self, root: str | Path, tokenizer: str | None = None) -> None:
        self.root = Path(root)
        paths = find_runs(self.root)
        self.runs = {self._name(p): Run(self._name(p), p) for p in paths}
        self.tokenizer_spec = tokenizer
        self._episodes: OrderedDict[tuple[str, int], Trajectory] = OrderedDict()
        self._lock = threading.Lock()
        self._decoders: dict[tuple[str, str | None], tuple[Any, str | None]] = {}

    def _name(self, path: Path) -> str:
        rel = path.relative_to(self.root).as_posix()
        return self.root.resolve().name if rel == "." else rel

    def run(self, name: str | None) -> Run:
        if name is None and len(self.runs) == 1:
            return next(iter(self.runs.values()))
        if name not in self.runs:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no run {name!r} here; the runs are: {', '.join(self.runs)}")
        return self.runs[name]

    # ------------------------------------------------------------------ answers
    def runs_json(self) -> dict[str, Any]:
        return {"root": str(self.root), "runs": [r.describe() for r in self.runs.values()]}

    def episodes_json(self, query: dict[str, str]) -> dict[str, Any]:
        run = self.run(query.get("run"))
        index = run.index()
        try:
            chosen = index.select(EpisodeFilter.from_query(query))
        except ValueError as err:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(err)) from None
        offset = _int(query, "offset", 0, 0, None)
        limit = _int(query, "limit", PAGE_SIZE, 1, 500)
        page = chosen[offset : offset + limit].tolist()
        return {"run": run.name, "total": len(index), "matched": int(len(chosen)), "offset": offset, "limit": limit,
                "rows": [index.row(i) for i in page], "facets": index.facets()}

    def group_json(self, query: dict[str, str]) -> dict[str, Any]:
        run = self.run(query.get("run"))
        group = query.get("group")
        if not group:
            raise ApiError(HTTPStatus.BAD_REQUEST, "group: which group (an episode's metadata['group'])")
        index = run.index()
        members = index.members(group)
        if not members:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no episode of group {group!r} in {run.name}")
        return {"run": run.name, "group": group, "rows": [index.row(i) for i in members]}

    def trajectory(self, run: Run, i: int) -> Trajectory:
        key = (run.name, i)
        with self._lock:
            if key in self._episodes:
                self._episodes.move_to_end(key)
                return self._episodes[key]
        index = run.index()
        if not 0 <= i < len(index):
            raise ApiError(HTTPStatus.NOT_FOUND, f"episode {i}: {run.name} holds {len(index)} episodes")
        try:
            traj = read_episode(run.path, index.files[index.file_of[i]], index.row_in_file[i])
        except FileNotFoundError:  # a live writer compacted the log the index pointed into
            index = run.refresh()
            traj = read_episode(run.path, index.files[index.file_of[i]], index.row_in_file[i])
        with self._lock:
            self._episodes[key] = traj
            while len(self._episodes) > 16:
                self._episodes.popitem(last=False)
        return traj

    def decoder(self, run: Run) -> tuple[Any, str | None]:
        """(tokenizer, warning) for a run: ``--tokenizer``, else the store's pinned or packaged name;
        worked out once per run and tokenizer (loading and fingerprinting take a second or two)."""
        key = (run.name, self.tokenizer_spec)
        with self._lock:
            known = self._decoders.get(key)
        if known is None:
            known = self._find_decoder(run)
            with self._lock:
                self._decoders[key] = known
        return known

    def _find_decoder(self, run: Run) -> tuple[Any, str | None]:
        from tokengym.envs.tokenizers import is_offline_name

        from ..store import tokenizer_fingerprint
        from ..store.manifest import read_manifest

        manifest = read_manifest(run.path) or {}
        spec = self.tokenizer_spec or manifest.get("tokenizer_name")
        if not spec or (self.tokenizer_spec is None and not is_offline_name(str(spec))):
            raise ApiError(HTTPStatus.CONFLICT, f"the store's tokenizer {spec!r} is not a pinned or packaged name: "
                           "start the viewer with --tokenizer NAME_OR_FOLDER to decode the tokens")
        try:
            tok = _tokenizer(str(spec))
        except (OSError, RuntimeError, ValueError, ImportError) as err:
            raise ApiError(HTTPStatus.CONFLICT, f"could not load the tokenizer {spec!r} ({err}); "
                           "start the viewer with --tokenizer") from None
        want = manifest.get("tokenizer_hash")
        note = None
        if want and tokenizer_fingerprint(tok) != want:
            note = (f"tokenizer {spec!r} has another fingerprint than the store's: another vocabulary or chat "
                    "template; the text may not be what the policy saw")
        return tok, note

    def episode_json(self, query: dict[str, str]) -> dict[str, Any]:
        run = self.run(query.get("run"))
        i = _int(query, "i", None, 0, None)
        traj = self.trajectory(run, i)
        tok, note = self.decoder(run)
        try:
            out = episode_json(traj, tok, i, _int(query, "start", 0, 0, None), _int(query, "limit", WINDOW, 1, WINDOW))
        except ValueError as err:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(err)) from None
        out["run"], out["tokenizer_warning"] = run.name, note
        return out

    def image_png(self, query: dict[str, str]) -> bytes:
        run = self.run(query.get("run"))
        traj = self.trajectory(run, _int(query, "i", None, 0, None))
        k = _int(query, "k", None, 0, None)
        found = [im for im in traj.images if im.index == k]
        if not found:
            raise ApiError(HTTPStatus.NOT_FOUND, f"episode has no image #{k}")
        buf = io.BytesIO()
        found[0].image.save(buf, format="PNG")
        return buf.getvalue()


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _int(query: dict[str, str], key: str, default: int | None, low: int, high: int | None) -> int:
    raw = query.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{key}: missing")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{key}={raw!r} is not a whole number") from None
    if value < low or (high is not None and value > high):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{key}={value}: between {low} and {high if high is not None else 'any'}")
    return value


class _Handler(BaseHTTPRequestHandler):
    server: ViewerServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if self.server.log_requests:
            super().log_message(format, *args)

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", _CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: HTTPStatus, value: Any) -> None:
        self._send(status, json.dumps(_finite(value), allow_nan=False, default=str).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        if self.headers.get("Host") not in self.server.hosts:
            self._json(HTTPStatus.MISDIRECTED_REQUEST, {"error": "this viewer answers only at " + self.server.url})
            return
        query = dict(parse_qsl(url.query))
        viewer = self.server.viewer
        try:
            if url.path in _STATIC:
                name, kind = _STATIC[url.path]
                self._send(HTTPStatus.OK, resources.files(__package__).joinpath("static", name).read_bytes(), kind)
            elif url.path == "/favicon.ico":  # none: a browser asks for it
                self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
            elif url.path == "/api/runs":
                self._json(HTTPStatus.OK, viewer.runs_json())
            elif url.path == "/api/episodes":
                self._json(HTTPStatus.OK, viewer.episodes_json(query))
            elif url.path == "/api/group":
                self._json(HTTPStatus.OK, viewer.group_json(query))
            elif url.path == "/api/episode":
                self._json(HTTPStatus.OK, viewer.episode_json(query))
            elif url.path == "/api/image":
                self._send(HTTPStatus.OK, viewer.image_png(query), "image/png")
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {url.path}"})
        except ApiError as err:
            self._json(err.status, {"error": str(err)})
        except (StoreError, OSError, IndexError, ValueError) as err:  # a damaged or vanished store, named
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(err).__name__}: {err}"})


class ViewerServer(ThreadingHTTPServer):
    """``ViewerServer(Viewer(DIR))``: serving on 127.0.0.1 once ``serve_forever`` runs (``.url`` says where)."""

    daemon_threads = True

    def __init__(self, viewer: Viewer, port: int = 0, *, log_requests: bool = False) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.viewer = viewer
        self.log_requests = log_requests
        host, bound = self.server_address[:2]
        self.url = f"http://{host}:{bound}/"
        self.hosts = {f"{host}:{bound}", f"localhost:{bound}"}

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A page that went away mid-answer (the browser moved on) is not an error; anything else is printed."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)
