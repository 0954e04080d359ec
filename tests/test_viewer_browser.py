"""``tokengym view`` in a real browser: Debian's Chromium driven by Playwright, clicking through the
runs, an episode list and its filters, one episode, and two episodes of a group side by side.

With ``TOKENGYM_VIEWER_SCREENSHOTS=DIR`` the views' screenshots are written there (docs/viewer/ holds
the ones the docs show: ``python -m pytest tests/test_viewer_browser.py`` with it set to docs/viewer).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.needs import missing
from tests.viewer_stores import HOSTILE_ESCAPE, HOSTILE_HTML, write_calc, write_hostile, write_pictures, write_sampled
from tokengym.recorder import read_trajectories
from tokengym.recorder.viewer import Viewer, ViewerServer

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("TOKENGYM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("BROWSER", "Playwright is not installed (pip install playwright; the browser: apt install chromium)")
    if CHROMIUM is None:
        missing("BROWSER", "no Chromium here (apt install chromium, or TOKENGYM_CHROMIUM=/path/to/chrome)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(qwen25, qwen3, tmp_path_factory) -> Iterator[ViewerServer]:
    from tokengym.envs.template_corpus import corpus_tokenizer

    root = tmp_path_factory.mktemp("runs")
    write_calc(root / "calc", qwen25)
    write_sampled(root / "sampled", qwen3)
    write_hostile(root / "hostile", qwen3)
    write_pictures(root / "pictures", corpus_tokenizer("Qwen3.5-4B")[0])
    srv = ViewerServer(Viewer(root))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def page(browser):
    # The server's Content-Security-Policy is lifted here (Playwright's checks evaluate script the policy
    # forbids): what keeps a hostile store inert below is the page building its elements from text alone.
    context = browser.new_context(viewport={"width": 1400, "height": 900}, bypass_csp=True)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("dialog", lambda d: (errors.append("dialog: " + d.message), d.dismiss()))
    requests: list[str] = []
    pg.on("request", lambda r: requests.append(r.url))
    pg.errors, pg.requests = errors, requests
    yield pg
    context.close()


def shot(page, name: str) -> None:
    """A screenshot of the view: always taken (a view that cannot be drawn fails here), kept where asked."""
    png = page.screenshot(full_page=False)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    folder = os.environ.get("TOKENGYM_VIEWER_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.png").write_bytes(png)


def test_list_then_episode_then_group_compare(server, page):
    page.goto(server.url)
    page.wait_for_selector("#runs")
    assert page.locator("tr.run-row").count() == 4
    shot(page, "runs")
    page.click("text=calc")
    page.wait_for_selector("#episodes tr.episode-row")
    assert page.locator("tr.episode-row").count() == 12
    assert page.inner_text("#page-info") == "1–12 of 12 episodes"
    trajs = list(read_trajectories(server.viewer.runs["calc"].path))
    page.fill("#f-reward_min", "0.5")
    page.click("#apply")
    page.wait_for_function("document.querySelector('#page-info').textContent.includes('(of 12')")
    rewards = [float(x) for x in page.locator("tr.episode-row td.reward").all_inner_texts()]
    assert rewards and all(r >= 0.5 for r in rewards) and len(rewards) == sum(t.reward >= 0.5 for t in trajs)
    shot(page, "episodes")
    page.click("#clear")
    page.wait_for_function("document.querySelectorAll('tr.episode-row').length === 12")
    i = next(k for k, t in enumerate(trajs) if t.num_turns == 2)
    page.click(f"tr.episode-row[data-index='{i}'] td.stop")
    page.wait_for_selector("pre.stream")
    stream = page.inner_text("pre.stream")
    assert "calculate" in stream and "<tool_response>" in stream and "<|im_start|>" in stream
    assert page.locator("pre.stream .badge").count() == 2  # a badge at each turn's action
    row = page.locator("#tool-calls tr").nth(1).locator("td").all_inner_texts()
    assert row[:4] == ["0", "0", "calculate", "ok"] and "<tool_response>" in row[4]
    assert page.locator("#turns tr").count() == 3 and "ok" in page.inner_text("#conformance")
    assert page.locator("pre.stream .k-action").count() == int(trajs[i].mask.sum())  # one span per policy token
    shot(page, "episode")
    group = str(trajs[i].metadata["group"])
    other = page.locator("#group-members a.compare").first
    j = int(other.get_attribute("data-index"))
    other.click()
    page.wait_for_selector("#compare section.episode >> nth=1")
    heads = page.locator("#compare section.episode h2").all_inner_texts()
    assert heads[0].startswith(f"episode {i} ") and heads[1].startswith(f"episode {j} ")
    assert page.inner_text("#compare-note") == f"group {group}"
    box_a, box_b = (page.locator("#compare section.episode").nth(k).bounding_box() for k in (0, 1))
    assert box_a["x"] + box_a["width"] <= box_b["x"] and abs(box_a["y"] - box_b["y"]) < 1  # side by side
    shot(page, "compare")
    assert not page.errors, page.errors
    assert all(u.startswith(server.url) for u in page.requests)  # nothing from the network


def test_policy_tokens_are_shaded_by_their_logprobs_and_the_list_pages(server, page):
    trajs = list(read_trajectories(server.viewer.runs["sampled"].path))
    page.goto(server.url + "#/run/sampled?limit=3")
    page.wait_for_selector("tr.episode-row")
    assert page.locator("tr.episode-row").count() == 3 and not page.is_enabled("#prev")
    page.click("#next")
    page.wait_for_function("document.querySelector('#page-info').textContent.startsWith('4–4 of 4')")
    page.goto(server.url + "#/run/sampled/episode/0")
    page.wait_for_selector("pre.stream")
    spans = page.locator(".k-action[data-logprob]")
    lps = [float(x) for x in spans.evaluate_all("els => els.map(e => e.dataset.logprob)")]
    want = trajs[0].logprobs[trajs[0].mask.astype(bool)]
    assert lps == pytest.approx(want.tolist(), rel=1e-5)
    colours = spans.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
    alpha = [float(c.rsplit(",", 1)[1].rstrip(")")) for c in colours]
    order = sorted(range(len(lps)), key=lambda k: lps[k])
    assert alpha[order[0]] > alpha[order[-1]]  # the least likely token is the reddest
    shot(page, "logprobs")
    assert not page.errors, page.errors


def test_images_stand_where_their_tokens_are(server, page):
    page.goto(server.url + "#/run/pictures/episode/0")
    page.wait_for_selector("pre.stream img.tg-image")
    img = page.locator("pre.stream img.tg-image")
    assert img.count() == 1 and img.evaluate("e => e.complete && e.naturalWidth") == 112
    before = img.evaluate("e => e.previousSibling.textContent")
    assert before == "<|vision_start|>"
    assert "another fingerprint" in page.inner_text("section.episode")  # qwen3 decodes it, with Qwen3.5's template
    img.scroll_into_view_if_needed()
    shot(page, "images")
    assert not page.errors, page.errors


def test_hostile_text_is_shown_never_run_and_huge_episodes_come_in_windows(server, page):
    page.goto(server.url + "#/run/hostile")
    page.wait_for_selector("tr.episode-row")
    page.click("tr.episode-row[data-index='0'] td.stop")
    page.wait_for_selector("pre.stream")
    text = page.inner_text("section.episode")
    assert HOSTILE_HTML in text and "␛[2J" in text and "␛[31mred" in text  # escapes as pictures
    assert page.evaluate("window.__pwned") is None
    assert page.locator("script").count() == 1 and page.locator("img").count() == 0
    assert page.locator("h2").first.inner_text().startswith("episode 0 · evil/<script>")
    assert HOSTILE_ESCAPE not in text
    page.goto(server.url + "#/run/hostile/episode/1")
    page.wait_for_selector("section.episode[data-index='1'] pre.stream")
    assert page.inner_text("#window-info") == "tokens 0–4096 of 20000"
    assert page.locator("pre.stream span.tok").count() == 4096
    page.click("#window-next")
    page.wait_for_function("document.querySelector('#window-info').textContent === 'tokens 4096–8192 of 20000'")
    assert not page.errors, page.errors
