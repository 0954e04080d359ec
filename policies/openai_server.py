"""A policy that talks to a running OpenAI-compatible server (``vllm serve``) by token ids.

Each context goes to the completions endpoint as a list of token ids (the server never
sees text from us), and the sampled tokens come back as ids: with
``return_tokens_as_token_ids`` vLLM names every returned token ``"token_id:N"``, so
nothing is decoded and re-encoded on the way. ``logprobs=1`` gives the sampled token's
logprob; which kind it is (raw or processed) is the server's ``--logprobs-mode`` (raw by
default in vLLM 0.10 and later): tell the policy with ``logprob_kind``.

Every sampling field is sent explicitly (temperature, top-p, top-k, min-p, penalties),
so the server's defaults from the model's ``generation_config.json`` cannot change the
sampling silently. The semantics are those of the other adapters: stop tokens and stop
strings stay in the output, only the requested stop tokens stop (``ignore_eos``), and
every request carries its own seed. The prompt's token count reported by the server is
checked against the context (and the prompt ids themselves when the server returns them).

Only the standard library is used (``http.client``, ``json``). Requests run in up to
``max_concurrency`` worker threads, each with its own kept-alive connection (a connection pool:
no TCP handshake per turn), from ``generate`` and ``agenerate`` alike; the server batches what
is in flight.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .base import FinishReason, Generation, LogprobKind, SamplingParams, check_contexts, per_request

__all__ = ["OpenAIServerPolicy", "ServerError", "ServerUnreachable"]

_TOKEN = re.compile(r"token_id:(-?\d+)")


class ServerUnreachable(ConnectionError):
    """No server answers at the configured address."""


class ServerError(RuntimeError):
    """The server answered with an error, or with something this adapter cannot use."""


class OpenAIServerPolicy:
    """Generates through an OpenAI-compatible completions endpoint, token ids in and out.

    Concurrent requests go to the server as they come (``agenerate``): the server batches them.

    Args:
        base_url: the server's address, with or without ``/v1`` (``http://127.0.0.1:8000``).
        model: the served model name (``--served-model-name``, or the path it was started with).
        api_key: sent as a bearer token when given.
        logprob_kind: what the server's logprobs are (``"raw"`` for vLLM's default
            ``--logprobs-mode raw_logprobs``; ``"processed"`` for ``processed_logprobs``).
        timeout: seconds for one request.
        max_concurrency: requests in flight at once (and kept-alive connections).
        max_model_len: clamps ``max_tokens`` to the room left after the context; read from
            ``/v1/models`` on first use when not given (vLLM reports it there).
        extra_body: more request fields, merged last (server-specific options).

    Weight versions: a server that says which weights sampled each output token (vLLM's
    ``weight_versions`` spans, ``[{"version", "start", "end"}]``, integer versions) has them
    stamped on the tokens; one that does not leaves them unknown (``Generation.versions`` None,
    ``-1`` in the trajectory, counted as "of unknown version" by ``tokengym inspect``), and
    ``version`` is None: the weights behind a server are the server's to change.
    """

    version = None

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        logprob_kind: LogprobKind = "raw",
        timeout: float = 600.0,
        max_concurrency: int = 32,
        max_model_len: int | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if logprob_kind not in ("raw", "processed"):
            raise ValueError(f"logprob_kind must be 'raw' or 'processed', got {logprob_kind!r}")
        url = base_url.rstrip("/")
        self.base_url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.model = model
        self.api_key = api_key
        self.logprob_kind: LogprobKind = logprob_kind
        self.timeout = timeout
        self.max_concurrency = max(1, int(max_concurrency))
        self.extra_body = dict(extra_body or {})
        self._max_model_len = max_model_len
        self._asked_max_len = False
        self.name = f"openai:{model}@{self.base_url}"
        self.continuous_batching = True
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._connections: list[Any] = []

    # -- HTTP ---------------------------------------------------------------------------

    def _connection(self, timeout: float) -> Any:
        """This thread's keep-alive connection to the server (one per worker thread: the pool)."""
        import http.client
        from urllib.parse import urlsplit

        conn = getattr(self._local, "conn", None)
        if conn is None:
            parts = urlsplit(self.base_url)
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = kind(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
            self._local.conn, self._local.fresh = conn, True
            with self._lock:
                self._connections.append(conn)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._lock:
                if conn in self._connections:
                    self._connections.remove(conn)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """One request on this thread's kept-alive connection; a connection the server closed
        while idle is opened again once."""
        import http.client
        from urllib.parse import urlsplit

        url = f"{self.base_url}{path}"
        limit = self.timeout if timeout is None else timeout
        headers = {"Accept": "application/json", "Connection": "keep-alive"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        target = urlsplit(self.base_url).path.rstrip("/") + path
        for attempt in (0, 1):
            conn = self._connection(limit)
            reused = not getattr(self._local, "fresh", True)
            self._local.fresh = False
            try:
                conn.request(method, target, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (socket.timeout, TimeoutError):
                self._drop_connection()
                raise ServerError(f"{method} {url}: no answer within {limit} s") from None
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, http.client.BadStatusLine) as err:
                self._drop_connection()
                if reused and attempt == 0:
                    continue  # the server closed an idle connection: once more on a new one
                raise ServerUnreachable(
                    f"the OpenAI-compatible server at {self.base_url} closed the connection ({method} {path}): {err!r}"
                ) from None
            except OSError as err:
                self._drop_connection()
                raise ServerUnreachable(
                    f"cannot reach the OpenAI-compatible server at {self.base_url} ({method} {path}): {err}. "
                    "Is it running and listening on that address?"
                ) from None
            if resp.will_close:
                self._drop_connection()
            break
        if resp.status >= 400:
            detail = raw.decode(errors="replace")[:2000]
            raise ServerError(f"{method} {url} failed with HTTP {resp.status}: {detail}")
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ServerError(f"{method} {url} answered with non-JSON: {raw[:200]!r}") from None

    def _executor(self) -> ThreadPoolExecutor:
        """The worker threads that send requests: at most ``max_concurrency`` in flight, each
        thread with its own kept-alive connection."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="tokengym-http")
            return self._pool

    def close(self) -> None:
        """Close the connections and stop the worker threads (a later request opens them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
            conns, self._connections = self._connections, []
        if pool is not None:
            pool.shutdown(wait=True)
        for conn in conns:
            conn.close()

    def __enter__(self) -> OpenAIServerPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def models(self) -> list[dict[str, Any]]:
        """The served models (``GET /v1/models``)."""
        return list(self._request("GET", "/v1/models", timeout=min(self.timeout, 30.0)).get("data", []))

    def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.5) -> None:
        """Poll ``/v1/models`` until the server lists ``model``; raise after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                served = [m.get("id") for m in self.models()]
                if self.model in served:
                    return
                last = ServerError(f"the server serves {served}, not {self.model!r}")
            except (ServerUnreachable, ServerError) as err:
                last = err
            time.sleep(interval)
        raise TimeoutError(f"the server at {self.base_url} was not ready after {timeout:g} s: {last}")

    @property
    def max_model_len(self) -> int | None:
        """The served context length (asked once; ``None`` when the server does not say)."""
        if self._max_model_len is None and not self._asked_max_len:
            self._asked_max_len = True
            for m in self.models():
                if m.get("id") == self.model and m.get("max_model_len"):
                    self._max_model_len = int(m["max_model_len"])
        return self._max_model_len

    # -- generation ---------------------------------------------------------------------

    def request_body(self, context: Sequence[int], sp: SamplingParams) -> dict[str, Any]:
        """The completions request for one context (exposed for inspection and tests)."""
        limit = self.max_model_len
        max_tokens = sp.max_tokens if limit is None else min(sp.max_tokens, limit - len(context))
        if max_tokens < 1:
            raise ValueError(f"a context of {len(context)} tokens leaves no room to generate (max_model_len {limit})")
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [int(t) for t in context],
            "max_tokens": max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "n": 1,
            "stream": False,
            "echo": False,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "stop_token_ids": list(sp.stop_token_ids),
            "include_stop_str_in_output": True,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "add_special_tokens": False,
        }
        if sp.stop_strings:
            body["stop"] = list(sp.stop_strings)
        if sp.seed is not None:
            body["seed"] = int(sp.seed)
        body.update(self.extra_body)
        return body

    def _one(self, context: Sequence[int], sp: SamplingParams) -> Generation:
        response = self._request("POST", "/v1/completions", self.request_body(context, sp))
        return parse_completion(response, context, self.logprob_kind)

    def generate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """One completions request per context, sent concurrently; results in context order."""
        params = per_request(sampling, len(contexts))
        contexts = check_contexts(contexts)
        if not contexts:
            return []
        return list(self._executor().map(self._one, contexts, params))

    async def agenerate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """The async form: each request on a worker thread's kept-alive connection, at most
        ``max_concurrency`` in flight over all calls; the server batches them."""
        import asyncio

        params = per_request(sampling, len(contexts))
        contexts = check_contexts(contexts)
        loop, pool = asyncio.get_running_loop(), self._executor()
        return list(await asyncio.gather(*(loop.run_in_executor(pool, self._one, c, p) for c, p in zip(contexts, params))))


def _token_id(token: Any) -> int:
    m = _TOKEN.fullmatch(str(token))
    if m is None:
        raise ServerError(
            f"the server returned the token {token!r}, not 'token_id:N': does it support return_tokens_as_token_ids?"
        )
    return int(m.group(1))


def parse_completion(response: dict[str, Any], context: Sequence[int], kind: LogprobKind) -> Generation:
    """A :class:`Generation` from a completions response to a token-id prompt."""
    try:
        choice = response["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"no choices in the server's response: {str(response)[:500]}") from None
    logprobs = choice.get("logprobs") or {}
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if tokens is None or values is None:
        raise ServerError("the response has no token logprobs: the server ignored logprobs=1")
    ids = [_token_id(t) for t in tokens]
    if len(values) != len(ids) or any(v is None for v in values):
        raise ServerError(f"{len(values)} logprobs (some missing) for {len(ids)} tokens")
    direct = choice.get("token_ids")
    if direct is not None and [int(t) for t in direct] != ids:
        raise ServerError(f"token_ids {direct} disagree with the logprob tokens {ids}")
    prompt_ids = choice.get("prompt_token_ids")
    if prompt_ids is not None and [int(t) for t in prompt_ids] != [int(t) for t in context]:
        raise ServerError("the server's prompt token ids are not the context that was sent")
    usage = response.get("usage") or {}
    if usage.get("prompt_tokens") is not None and int(usage["prompt_tokens"]) != len(context):
        raise ServerError(f"the server counted {usage['prompt_tokens']} prompt tokens for a context of {len(context)}")
    reason, stop = choice.get("finish_reason"), choice.get("stop_reason")
    finish: FinishReason
    if reason == "length":
        finish = "length"
    elif reason == "stop":
        if isinstance(stop, str):
            finish = "stop_string"
        elif isinstance(stop, int) and (not ids or ids[-1] != stop):
            raise ServerError(f"the server stopped on token {stop} but left it out of the output {ids[-5:]}")
        else:
            finish = "stop"
    else:
        raise ServerError(f"the server finished with reason {reason!r} (stop_reason={stop!r})")
    info = {"stop_reason": stop} if stop is not None else {}
    versions = weight_versions(choice.get("weight_versions"), len(ids))
    return Generation(np.array(ids, dtype=np.int64), np.array(values, dtype=np.float32), finish, kind, info,
                      versions=versions)


def weight_versions(spans: Any, n: int) -> np.ndarray | None:
    """The per-token versions of a server's ``weight_versions`` spans (vLLM's: ``version``, ``start``,
    ``end`` over the output tokens), or None when it gave none. Spans that leave a token out, or a
    version that is not an integer, are an error that says what the server sent."""
    if not spans:
        return None
    out = np.full(n, -1, dtype=np.int32)
    for span in spans:
        try:
            version, start, end = str(span["version"]), int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            raise ServerError(f"the server's weight_versions entry {span!r} is not {{version, start, end}}") from None
        if not version.lstrip("-").isdigit() or int(version) < 0:
            raise ServerError(f"the server labels its weights {version!r}: tokengym records integer versions >= 0")
        out[max(start, 0) : min(end, n)] = int(version)
    if (out < 0).any():
        raise ServerError(f"the server's weight_versions {spans!r} leave some of the {n} output tokens out")
    return out
