"""``tokengym view``: the runs, the episode index and its filters, one episode's tokens, over real HTTP.

The stores are real rollouts (tests/viewer_stores.py); the browser's side is tests/test_viewer_browser.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from tests.viewer_stores import HOSTILE_ESCAPE, HOSTILE_HTML, HUGE_TOKENS, write_calc, write_hostile, write_sampled
from tokengym.recorder import TrajectoryWriter, read_trajectories
from tokengym.recorder.store import StoreError
from tokengym.recorder.viewer import Viewer, ViewerServer, find_runs, token_pieces
from tokengym.recorder.viewer.episode import WINDOW


@pytest.fixture(scope="module")
def stores(qwen25, qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_calc(root / "calc", qwen25)
    write_sampled(root / "nested" / "sampled", qwen3)
    write_hostile(root / "hostile", qwen3)
    return root


@pytest.fixture(scope="module")
def server(stores) -> Iterator[ViewerServer]:
    srv = ViewerServer(Viewer(stores))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def get(srv: ViewerServer, path: str, **params: object) -> tuple[int, object]:
    from urllib.parse import urlencode

    url = srv.url.rstrip("/") + path + ("?" + urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            body = r.read()
            return r.status, (json.loads(body) if r.headers["Content-Type"] == "application/json" else body)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_runs_under_a_folder_are_found_and_a_folder_without_one_is_refused(stores, tmp_path):
    assert [p.relative_to(stores).as_posix() for p in find_runs(stores)] == ["calc", "hostile", "nested/sampled"]
    assert find_runs(stores / "calc") == [stores / "calc"]
    (tmp_path / "empty" / "deeper").mkdir(parents=True)
    with pytest.raises(StoreError, match="no trajectory store"):
        find_runs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        find_runs(tmp_path / "missing")


def test_it_listens_on_127_0_0_1_only_and_answers_only_that_host(server):
    assert server.server_address[0] == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
    req = urllib.request.Request(server.url + "api/runs", headers={"Host": "evil.example:80"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 421
    with urllib.request.urlopen(server.url, timeout=10) as r:
        page, csp = r.read().decode(), r.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched from elsewhere


def test_the_runs_and_their_episodes(server, qwen25):
    code, runs = get(server, "/api/runs")
    assert code == 200 and [r["name"] for r in runs["runs"]] == ["calc", "hostile", "nested/sampled"]
    assert [r["episodes"] for r in runs["runs"]] == [12, 2, 4]
    code, page = get(server, "/api/episodes", run="calc", limit=5)
    assert code == 200 and page["total"] == page["matched"] == 12 and len(page["rows"]) == 5
    trajs = list(read_trajectories(server.viewer.runs["calc"].path))
    for row in page["rows"]:
        t = trajs[row["index"]]
        assert row["reward"] == t.reward and row["tokens"] == len(t) and row["turns"] == t.num_turns
        assert row["group"] == str(t.metadata["group"]) and row["task"] == t.metadata["task_id"]
    assert page["facets"]["group"] == {"0": 3, "1": 3, "2": 3, "3": 3}
    code, rest = get(server, "/api/episodes", run="calc", limit=5, offset=10)
    assert [r["index"] for r in rest["rows"]] == [10, 11]


def test_filters_select_what_they_say(server):
    trajs = list(read_trajectories(server.viewer.runs["calc"].path))
    _, won = get(server, "/api/episodes", run="calc", reward_min=0.5, limit=500)
    assert {r["index"] for r in won["rows"]} == {i for i, t in enumerate(trajs) if t.reward >= 0.5}
    assert 0 < won["matched"] < 12
    _, two = get(server, "/api/episodes", run="calc", group="2", reward_max=0.5)
    assert {r["index"] for r in two["rows"]} == {i for i, t in enumerate(trajs) if t.metadata["group"] == 2 and t.reward <= 0.5}
    task = trajs[0].metadata["task_id"]
    _, same = get(server, "/api/episodes", run="calc", task=task)
    assert {r["index"] for r in same["rows"]} == {i for i, t in enumerate(trajs) if t.metadata["task_id"] == task}
    _, cut = get(server, "/api/episodes", run="hostile", finish="length")
    assert [r["index"] for r in cut["rows"]] == [1]
    _, ok = get(server, "/api/episodes", run="calc", conformance="ok")
    assert ok["matched"] == 12
    for bad, says in (({"reward_min": "x"}, "not a number"), ({"conformance": "nope"}, "one of"),
                      ({"offset": "-1"}, "between"), ({"run": "nope"}, "no run")):
        code, err = get(server, "/api/episodes", **{"run": "calc", **bad})
        assert code in (400, 404) and says in err["error"], err


def test_an_episode_is_its_exact_tokens_with_logprobs_turns_and_tool_calls(server, qwen25, qwen3):
    trajs = list(read_trajectories(server.viewer.runs["calc"].path))
    i = next(k for k, t in enumerate(trajs) if t.num_turns == 2)  # a tool call, then the answer
    code, ep = get(server, "/api/episode", run="calc", i=i)
    assert code == 200 and ep["window"] == {"start": 0, "end": len(trajs[i]), "total": len(trajs[i]), "per_token": True}
    assert "".join(p[0] for p in ep["pieces"]) == qwen25.decode(trajs[i].token_ids.tolist(), skip_special_tokens=False)
    assert [p[1] for p in ep["pieces"]] == list(range(len(trajs[i])))
    assert [p[3] for p in ep["pieces"]] == [s.kind.value for s in trajs[i].segments for _ in range(len(s))]
    call = {"turn": 0, "index": 0, "name": "calculate", "status": "ok"}
    assert trajs[i].metadata["tool_calls"] == [call]
    obs = next(s for s in trajs[i].segments if s.kind.value == "observation")
    assert ep["tool_calls"] == [{**call, "result": qwen25.decode(obs.token_ids.tolist(), skip_special_tokens=False)}]
    assert [t["reward"] for t in ep["turns"]] == trajs[i].turn_rewards.tolist()
    assert ep["conformance"] == trajs[i].conformance and ep["group"] == str(trajs[i].metadata["group"])
    sampled = list(read_trajectories(server.viewer.runs["nested/sampled"].path))
    _, ep = get(server, "/api/episode", run="nested/sampled", i=0)
    lp = [p[2] for p in ep["pieces"]]
    want = [float(x) if m else None for x, m in zip(sampled[0].logprobs, sampled[0].mask)]
    assert lp == pytest.approx(want) and any(x is not None for x in lp)


def test_a_group_lists_its_members(server):
    code, g = get(server, "/api/group", run="calc", group="1")
    assert code == 200 and [r["index"] for r in g["rows"]] == [3, 4, 5]
    assert get(server, "/api/group", run="calc", group="9")[0] == 404


def test_token_pieces_join_to_the_decode_with_split_characters(qwen3, qwen25):
    text = "naïve 日本語 🦩ᚠᛇᚻ 𓀀 <tool_call>\n{\"a\": 1}</tool_call>\n\n\tend"
    for tok in (qwen3, qwen25):
        ids = np.asarray(tok.encode(text, add_special_tokens=False))
        pieces = token_pieces(tok, ids)
        assert pieces is not None and "".join(pieces) == tok.decode(ids.tolist()) and len(pieces) == len(ids)
        assert "" in pieces  # a character's bytes span tokens: its text goes to the token that finishes it


def test_hostile_text_comes_back_as_text_and_a_huge_episode_in_windows(server, qwen3):
    _, page = get(server, "/api/episodes", run="hostile")
    evil = page["rows"][0]
    assert evil["env_id"] == "evil/" + HOSTILE_HTML and evil["stop_reason"] == HOSTILE_ESCAPE
    code, ep = get(server, "/api/episode", run="hostile", i=1)
    assert code == 200 and ep["window"] == {"start": 0, "end": WINDOW, "total": HUGE_TOKENS, "per_token": True}
    assert len(ep["pieces"]) == WINDOW
    _, last = get(server, "/api/episode", run="hostile", i=1, start=HUGE_TOKENS - 10)
    assert last["window"]["end"] == HUGE_TOKENS and [p[1] for p in last["pieces"]] == list(range(HUGE_TOKENS - 10, HUGE_TOKENS))
    for bad in ({"start": HUGE_TOKENS}, {"i": 7}, {"i": "x"}, {"limit": WINDOW + 1}):
        code, err = get(server, "/api/episode", **{"run": "hostile", "i": 1, **bad})
        assert code in (400, 404) and err["error"], err


def test_nan_rewards_and_a_store_whose_tokenizer_cannot_be_loaded(qwen3, tmp_path):
    from tests.viewer_stores import write_hostile

    write_hostile(tmp_path / "s", qwen3)
    import dataclasses

    t = next(read_trajectories(tmp_path / "s"))
    t.segments[1] = dataclasses.replace(t.segments[1], reward=float("nan"))
    with TrajectoryWriter(tmp_path / "nan", tokenizer=qwen3, tokenizer_name="not-a-pinned-name") as w:
        w.write(t)
    srv = ViewerServer(Viewer(tmp_path / "nan"))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        code, page = get(srv, "/api/episodes")
        assert code == 200 and page["rows"][0]["reward"] == "nan"
        code, err = get(srv, "/api/episode", i=0)
        assert code == 409 and "--tokenizer" in err["error"]
        srv.viewer.tokenizer_spec = "qwen3"
        code, ep = get(srv, "/api/episode", i=0)
        assert code == 200 and ep["reward"] == "nan"
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_command_prints_where_it_serves_and_refuses_a_folder_without_a_store(stores, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tokengym.recorder.cli", "view", str(stores / "calc")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first, second = proc.stdout.readline(), proc.stdout.readline()
        assert "1 run, 12 episodes" in first and second.startswith("serving at http://127.0.0.1:"), (first, second)
        url = second.split()[2]
        with urllib.request.urlopen(url + "api/episodes", timeout=30) as r:
            assert json.loads(r.read())["total"] == 12
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    (tmp_path / "nothing").mkdir()
    done = subprocess.run([sys.executable, "-m", "tokengym.recorder.cli", "view", str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no trajectory store" in done.stderr


def test_the_list_reads_only_the_small_columns_and_an_episode_only_its_row(stores, monkeypatch):
    """A store of any size lists in pages: building the index asks for no token ids, masks or
    logprobs, and opening an episode reads its own row (its row group or log record) alone."""
    import pyarrow.parquet as pq

    from tokengym.recorder.store import rows as store_rows
    from tokengym.recorder.viewer import catalog, episode

    asked: list[list[str]] = []
    real = catalog.store_batches

    def spy(directory, tokenizer, chat_template, columns, batch_size):
        asked.append(list(columns))
        return real(directory, tokenizer, chat_template, columns, batch_size)

    monkeypatch.setattr(catalog, "store_batches", spy)
    viewer = Viewer(stores / "calc")
    index = viewer.run(None).index()
    assert len(index) == 12 and asked and not {"token_ids", "mask", "logprobs", "versions"} & set(sum(asked, []))
    read: list[str] = []
    real_group = pq.ParquetFile.read_row_group

    def one_group(self, i, *args, **kwargs):
        read.append(f"row group {i}")
        return real_group(self, i, *args, **kwargs)

    def decode(batch, path, first):
        read.append(f"{batch.num_rows} row of {path.name} from {first}")
        return store_rows.decode_batch(batch, path, first)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", one_group)
    monkeypatch.setattr(episode, "decode_batch", decode)
    traj = viewer.trajectory(viewer.run(None), 7)
    assert read == ["row group 0", "1 row of part-00001.parquet from 2"]  # shards of 5: row 7 is the second's third
    assert traj.to_dict() == list(read_trajectories(stores / "calc"))[7].to_dict()
