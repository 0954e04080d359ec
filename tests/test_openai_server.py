"""The OpenAI-compatible server adapter against a stub server (no vLLM needed).

The stub answers like vLLM's completions endpoint; the adapter's requests and its parsing
of the answers are checked here. ``tests/test_vllm.py`` runs the same adapter against a
real vLLM server.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokengym.policies import OpenAIServerPolicy, SamplingParams
from tokengym.policies.openai_server import ServerError, ServerUnreachable


class _Server(ThreadingHTTPServer):
    # A listen backlog like a real server's (uvicorn's is 2048), not socketserver's 5: sixteen
    # connections opened at once on a busy machine overflowed it and the kernel reset some.
    request_queue_size = 128


class Stub:
    """A loopback server: records the requests, answers with ``reply(body)``."""

    def __init__(self, reply, max_model_len=64, keep_alive=False, delay=0.0):
        self.requests: list[dict] = []
        self.reply = reply
        self.clients: set = set()  # (host, port) of every TCP connection made to it
        self.active = self.peak = 0
        self.drop = False
        lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                stub.clients.add(self.client_address)

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                if stub.drop:  # close without saying so, as a server does with an idle connection
                    self.close_connection = True

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": "m", "max_model_len": max_model_len}]})
                else:
                    self._send(404, {"error": "no such path"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    stub.requests.append(body)
                    stub.active += 1
                    stub.peak = max(stub.peak, stub.active)
                try:
                    time.sleep(delay)
                    code, payload = stub.reply(body)
                    self._send(code, payload)
                finally:
                    with lock:
                        stub.active -= 1

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def completion(ids, lps, finish="length", stop=None, prompt=None, prompt_tokens=None):
    choice = {
        "index": 0,
        "text": "",
        "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": lps},
        "finish_reason": finish,
        "stop_reason": stop,
        "token_ids": ids,
        "prompt_token_ids": prompt,
    }
    return {"choices": [choice], "usage": {"prompt_tokens": prompt_tokens if prompt_tokens is not None else len(prompt or [])}}


def echo_reply(body):
    """Generates ``[7, 8, 9][:max_tokens]``; stops on a requested stop token, like vLLM (kept)."""
    out = []
    for t in [7, 8, 9][: body["max_tokens"]]:
        out.append(t)
        if t in body["stop_token_ids"]:
            return 200, completion(out, [-1.0] * len(out), "stop", t, body["prompt"])
    return 200, completion(out, [-1.0] * len(out), "length", None, body["prompt"])


def test_requests_carry_token_ids_and_every_sampling_field():
    with Stub(echo_reply) as stub:
        policy = OpenAIServerPolicy(stub.url + "/v1", "m")
        sp = SamplingParams(max_tokens=100, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop_token_ids=(9,), stop_strings=("</a>",))
        gen = policy.generate([[1, 2, 3]], sp)[0]
    body = stub.requests[0]
    assert body["prompt"] == [1, 2, 3] and body["model"] == "m"
    assert body["max_tokens"] == 61  # clamped to max_model_len 64 minus the context
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (0.7, 0.9, 5, 3)
    assert body["min_p"] == 0.0 and body["repetition_penalty"] == 1.0 and body["presence_penalty"] == 0.0
    assert body["logprobs"] == 1 and body["return_tokens_as_token_ids"] and body["ignore_eos"]
    assert body["stop_token_ids"] == [9] and body["stop"] == ["</a>"] and body["include_stop_str_in_output"]
    assert body["add_special_tokens"] is False and body["skip_special_tokens"] is False
    assert gen.token_ids.tolist() == [7, 8, 9] and gen.finish_reason == "stop" and gen.logprob_kind == "raw"
    assert gen.logprobs.tolist() == [-1.0, -1.0, -1.0]


def test_batches_keep_their_order_and_finish_reasons_map():
    replies = {
        1: completion([5], [-0.5], "stop", "</a>", [1]),
        2: completion([6, 6], [-0.1, -0.2], "length", None, [2]),
    }
    with Stub(lambda body: (200, replies[body["prompt"][0]])) as stub:
        policy = OpenAIServerPolicy(stub.url, "m", max_model_len=64)
        gens = policy.generate([[1], [2]], SamplingParams(max_tokens=2))
    assert [g.finish_reason for g in gens] == ["stop_string", "length"]
    assert gens[0].info["stop_reason"] == "</a>" and gens[1].token_ids.tolist() == [6, 6]


@pytest.mark.parametrize(
    "response, match",
    [
        (completion([5, 6], [-1.0, -1.0], "stop", 9, [1]), "left it out"),
        (completion([5], [-1.0], "length", None, [1, 1]), "prompt token ids"),
        (completion([5], [-1.0], "length", None, None, prompt_tokens=4), "counted 4 prompt tokens"),
        (completion([5], [-1.0], "abort", None, [1]), "abort"),
        ({"choices": [{"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}, "finish_reason": "length"}]}, "token_id:N"),
        ({"choices": [{"logprobs": None, "finish_reason": "length"}]}, "no token logprobs"),
        ({"object": "error"}, "no choices"),
    ],
)
def test_answers_that_would_break_the_law_are_refused(response, match):
    with Stub(lambda body: (200, response)) as stub:
        policy = OpenAIServerPolicy(stub.url, "m", max_model_len=64)
        with pytest.raises(ServerError, match=match):
            policy.generate([[1]], SamplingParams(max_tokens=2))


def test_http_errors_carry_the_servers_message():
    with Stub(lambda body: (400, {"message": "prompt too long"})) as stub:
        policy = OpenAIServerPolicy(stub.url, "m", max_model_len=64)
        with pytest.raises(ServerError, match="HTTP 400.*prompt too long"):
            policy.generate([[1]], SamplingParams(max_tokens=2))


def test_an_unreachable_server_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = OpenAIServerPolicy(f"http://127.0.0.1:{port}", "m", timeout=5)
    with pytest.raises(ServerUnreachable, match=f"cannot reach the OpenAI-compatible server at http://127.0.0.1:{port}"):
        policy.generate([[1]], SamplingParams(max_tokens=2))
    with pytest.raises(TimeoutError, match="not ready"):
        policy.wait_until_ready(timeout=0.3, interval=0.1)


def test_wait_until_ready_and_the_async_form():
    import asyncio

    with Stub(echo_reply) as stub:
        policy = OpenAIServerPolicy(stub.url, "m")
        policy.wait_until_ready(timeout=5)
        assert policy.max_model_len == 64
        with pytest.raises(TimeoutError, match="serves"):
            OpenAIServerPolicy(stub.url, "other").wait_until_ready(timeout=0.3, interval=0.1)
        gens = asyncio.run(policy.agenerate([[1], [2, 3]], SamplingParams(max_tokens=2)))
    assert [g.token_ids.tolist() for g in gens] == [[7, 8], [7, 8]]
    with pytest.raises(ValueError, match="logprob_kind"):
        OpenAIServerPolicy("http://127.0.0.1:1", "m", logprob_kind="none")  # type: ignore[arg-type]


def test_connections_are_kept_alive_and_reopened_when_the_server_drops_them():
    with Stub(echo_reply, keep_alive=True) as stub:
        with OpenAIServerPolicy(stub.url, "m", max_model_len=64, max_concurrency=1) as policy:
            for _ in range(5):
                policy.generate([[1]], SamplingParams(max_tokens=2))
            assert len(stub.requests) == 5 and len(stub.clients) == 1  # one TCP connection for five requests
            stub.drop = True
            policy.generate([[1]], SamplingParams(max_tokens=2))  # answered, then the server closes
            stub.drop = False
            assert policy.generate([[1]], SamplingParams(max_tokens=2))[0].token_ids.tolist() == [7, 8]
            assert len(stub.requests) == 7 and len(stub.clients) == 2  # reopened once
    with Stub(echo_reply, keep_alive=False) as stub:  # an HTTP/1.0 server closes after each answer
        with OpenAIServerPolicy(stub.url, "m", max_model_len=64, max_concurrency=1) as policy:
            for _ in range(3):
                policy.generate([[1]], SamplingParams(max_tokens=2))
        assert len(stub.requests) == 3 and len(stub.clients) == 3


def test_async_requests_are_all_in_flight_up_to_max_concurrency():
    import asyncio

    with Stub(echo_reply, keep_alive=True, delay=1.0) as stub:
        with OpenAIServerPolicy(stub.url, "m", max_model_len=64, max_concurrency=16) as policy:

            async def many():
                return await asyncio.gather(*(policy.agenerate([[i]], SamplingParams(max_tokens=1)) for i in range(16)))

            gens = asyncio.run(many())
    # Not capped by asyncio's default thread pool (6 threads on 2 cores): each request has a thread and a
    # connection of its own (a busy machine may start the last one after the first has finished).
    assert len(gens) == 16 and stub.peak >= 12 and len(stub.clients) == 16
