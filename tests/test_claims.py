"""The README's measured numbers are the ones its scripts printed.

A number the README quotes from a benchmark or a notebook run is read here from that run's stored
output (``benchmarks/results/*.json``, written by the script's ``--json``, or the outputs stored
with the notebook) and must appear in the README as the script printed it. Re-running a script
and storing its output without updating the README (or the reverse) fails this test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "guide.md")
"""What docs/claims.md holds: the README's first screen and the guide it leads to."""


def _documents_text() -> str:
    return "\n\n".join(p.read_text(encoding="utf-8") for p in DOCUMENTS)


def _readme() -> str:
    return re.sub(r"\s+", " ", _documents_text())


def _notebook_text(name: str) -> str:
    nb = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))
    return "".join(
        "".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])
    )


def _one(pattern: str, text: str, what: str) -> re.Match:
    found = re.findall(pattern, text)
    assert len(found) == 1, f"{what}: expected one match of {pattern!r} in the stored output, found {len(found)}"
    return re.search(pattern, text)  # type: ignore[return-value]


def learn_claim() -> str:
    """The README's sentence on ``learn.ipynb``, built from the notebook's stored outputs."""
    out = _notebook_text("learn.ipynb")
    per_iteration = _one(r"(\d+\.\d) s per iteration \(", out, "time per iteration").group(1)
    total = int(_one(r"\n(\d+) s in all\n", out, "total time").group(1))
    iterations = int(_one(r"(\d+) iterations; mean of the first", out, "iterations").group(1))
    held = _one(
        r"held-out accuracy on all (\d+) questions: (\d\.\d\d) before training -> (\d\.\d\d) after \d+ updates; "
        r"on the (\d+) of them training never asked: (\d\.\d\d) -> (\d\.\d\d)",
        out, "held-out accuracy",
    ).groups()
    fmt = _one(r"format_ok\s+(\d\.\d+) -> (\d\.\d+)", out, "format rate").groups()
    reward = _one(r"\n  reward\s+(\d\.\d+) -> (\d\.\d+)", out, "reward").groups()
    return (
        f"It is stored with the outputs of its {iterations}-iteration run on 2 CPU cores ({per_iteration} s per "
        f"iteration, {total} s in all, about {round(total / 60)} minutes): held-out greedy accuracy {held[1]} -> "
        f"{held[2]} on its {held[0]} held-out questions, {held[4]} -> {held[5]} on the {held[3]} of them that "
        f"training never asked, format rate {float(fmt[0]):.2f} -> {float(fmt[1]):.2f} and mean reward "
        f"{float(reward[0]):.2f} -> {float(reward[1]):.2f} over the training samples (first 3 vs last 3 iterations)."
    )


def observation_claim() -> str:
    """The README's step-cost sentence, from ``benchmarks/observation_tokens.py --json``'s stored run."""
    stored = json.loads((RESULTS / "observation_tokens.json").read_text(encoding="utf-8"))
    res = max(stored["results"], key=lambda r: r["turns"])
    step = res["methods"]["step(default)"]
    runs = stored["over_runs"][str(res["turns"])]
    return (
        f"at {res['turns']} turns, is {runs['median']:.0f}x faster than re-rendering the whole "
        f"conversation each turn (mean per turn, the median of {len(runs['ratios'])} whole runs, "
        f"{runs['min']:.0f}x in the slowest; {step['baseline_over_this_last_quarter']:.0f}x in the last quarter), "
        f"measured turn by turn side by side (`python benchmarks/observation_tokens.py --json "
        f"benchmarks/results/observation_tokens.json`)"
    )


def scale_claim() -> str:
    """The README's driver-cost sentence, from ``benchmarks/scale.py --json``'s stored run."""
    stored = json.loads((RESULTS / "scale.json").read_text(encoding="utf-8"))
    by_size = {r["in_flight"]: r for r in stored["sizes"]}
    at, small, large = by_size[1000], by_size[min(by_size)], by_size[max(by_size)]
    missed = [g["goal"] for g in stored["goals"] if not g["met"]]
    return (
        f"the local driver, the recorder and the env cost {at['rollout_ms_per_turn']:.2f} ms of CPU per turn at "
        f"1,000 episodes in flight with the progress bar on, {at['ratio_to_bare']:.2f}x the env's bare `step` loop "
        f"(the median of {at['rounds']} rounds; {small['rollout_ms_per_turn']:.2f} ms at {small['in_flight']:,} in "
        f"flight, {large['rollout_ms_per_turn']:.2f} ms at {large['in_flight']:,}), building an env costs "
        f"{at['build_ms_per_env']:.1f} ms, and the recorder and the driver keep "
        f"{stored['memory']['bytes_per_token']:.0f} bytes per context token of an episode in flight on those short "
        f"turns ({stored['memory']['marginal_bytes_per_token']:.0f} per token and "
        f"{stored['memory']['bytes_per_turn'] / 1000:.1f} kB per turn whatever its length), while the whole "
        f"episode, its env included, holds {at['rss_per_episode_kb']:.0f} kB of {at['context_tokens']} tokens "
        f"({at['rss_bytes_per_context_token']:.0f} B per token) "
        f"(`python benchmarks/scale.py --json benchmarks/results/scale.json`"
        + ("" if not missed else "; it exits 1 on the goals it misses (" + "; ".join(missed) + ")")
        + ")"
    )


def pool_claim() -> str:
    """The README's process-pool sentence, from the same stored ``benchmarks/scale.py`` run."""
    stored = json.loads((RESULTS / "scale.json").read_text(encoding="utf-8"))
    at = {r["in_flight"]: r for r in stored["sizes"]}[1000]
    cross = stored["crossover"]
    here = (
        f"passes it after {cross['turns_to_pay_back_start']:,} turns" if cross["pool_faster_here"]
        else f"runs {at['pool_turns_per_s']:,.0f} turns/s against {at['rollout_turns_per_s']:,.0f} in one process"
    )
    return (
        f"At 1,000 episodes in flight the driver's own CPU is then {at['pool_driver_ms_per_turn']:.2f} ms per turn "
        f"(against {at['rollout_ms_per_turn']:.2f} ms with the envs in its process) and a worker spends "
        f"{at['pool_worker_ms_per_turn']:.2f} ms per turn; on a machine of {cross['cpus']} CPUs, with "
        f"{cross['workers']} worker{'s' if cross['workers'] > 1 else ''} after a start of {at['pool_start_s']:.1f} s, "
        f"the pool {here}, and from those costs it passes one process once it has "
        f"{cross['worker_cores_to_pass_rollout']} worker cores of its own "
        f"(`python benchmarks/scale.py --json benchmarks/results/scale.json`)"
    )


def collate_claim() -> str:
    """The README's collation sentence, from ``benchmarks/collate.py --json``'s stored run."""
    stored = json.loads((RESULTS / "collate.json").read_text(encoding="utf-8"))
    pad = stored["pad_token_id"]
    methods = stored["collate"]["methods"]
    fresh, kept = methods[f"to_verl (pad id {pad})"], methods[f"to_verl (pad id {pad}, reused buffers)"]
    verl = stored["verl"]["summary"]
    return (
        f"On {stored['n']:,} trajectories ({stored['tokens']:,} tokens, "
        f"{stored['collate']['batch_bytes'] / 1e6:,.0f} MB of tensors, Qwen3's real pad id), `to_verl` into kept "
        f"buffers is {verl['median_s'] / kept['median_s']:.0f}x faster than verl {stored['verl']['verl']}'s own "
        f"post-processing of the same samples (median to median; {verl['min_s'] / kept['max_s']:.0f}x for its "
        f"slowest call against verl's fastest), the seven tensors identical; a fresh batch in new memory is "
        f"{verl['median_s'] / fresh['median_s']:.0f}x at the median and {verl['min_s'] / fresh['max_s']:.0f}x for its "
        f"slowest call (`python benchmarks/collate.py --json benchmarks/results/collate.json`)"
    )


def _learning_run(name: str) -> tuple[dict, float, float, float]:
    """A stored ``benchmarks/learning.py --json`` run and its mean seconds per iteration (all,
    generation, training)."""
    d = json.loads((RESULTS / name).read_text(encoding="utf-8"))
    its = d["iterations"]
    gen = sum(i["generate_s"] for i in its) / len(its)
    train = sum(i["train_s"] for i in its) / len(its)
    return d, gen + train, gen, train


def learning_claim() -> str:
    """The README's sentence on ``benchmarks/learning.py``'s default run, from its stored output;
    it says "as in the notebook" only when the run's held-out numbers are the notebook's."""
    d, per, gen, train = _learning_run("learning.json")
    first, last = d["evals"][0]["metrics"]["correct"], d["evals"][-1]["metrics"]["correct"]
    never = d["held_out_never_asked"]
    numbers = f"{first:.2f} -> {last:.2f}", f"{never['before']:.2f} -> {never['after']:.2f}"
    notebook = _notebook_text("learn.ipynb")
    same = all(n in notebook for n in (f"before training -> {last:.2f}", f"{first:.2f} before", f": {numbers[1]}"))
    return (
        f"`benchmarks/learning.py` runs the same loop and prints the numbers: its default {len(d['iterations'])}-iteration "
        f"run (`{d['command']}`) took {(d['seconds'] + d['load_seconds']) / 60:.1f} minutes on {d['cpus']} cores shared with "
        f"other work (load average {d['load_average']:.1f} at its end; {d['seconds']:.0f} s for the loop and "
        f"{d['load_seconds']:.0f} s to load the model; {per:.1f} s per iteration: {gen:.1f} s generation, {train:.1f} s "
        f"training; peak RSS {d['peak_rss_gb']:.1f} GB): held-out greedy accuracy {numbers[0]}, {numbers[1]} on the "
        f"{never['questions']} questions training never asked"
        + (", the notebook's numbers (the run is seeded)." if same else "; the notebook's run gave other numbers.")
    )


def tool_learning_claim() -> str:
    """The README's sentence on the two-turn ``--env tool-addition`` run, from its stored output."""
    d, per, _, _ = _learning_run("learning_tool_addition.json")
    its = d["iterations"]
    signal, groups = sum(i["groups_with_signal"] for i in its), sum(i["groups"] for i in its)
    first, last = d["evals"][0], d["evals"][-1]
    n = len(first["episodes"])
    return (
        f"A {len(its)}-iteration run of it (`{d['command']}`: one question x 4 samples per iteration; {per:.1f} s per "
        f"iteration, peak RSS {d['peak_rss_gb']:.1f} GB) moved the sampled policy's held-out success from "
        f"{first['metrics']['correct']:.2f} to {last['metrics']['correct']:.2f} on {n} questions, with {signal} of its "
        f"{groups} groups carrying a signal ({sum(i['updated'] for i in its)} updates)"
        + (", as SmolLM2 with two worked examples already gets most groups all right, and such a run moves within "
           f"the noise of {n} questions." if 2 * signal < groups else ".")
    )


def gpu_claim() -> str:
    """The README's sentence on the law on a GPU, from ``benchmarks/gpu_law.py --json``'s stored runs."""
    runs = [json.loads((RESULTS / f).read_text(encoding="utf-8")) for f in ("gpu_law.json", "gpu_law_big.json")]
    f32 = [next(r for r in run["runs"] if r["dtype"] == "float32") for run in runs]
    bf16 = [next(r for r in run["runs"] if r["dtype"] == "bfloat16") for run in runs]
    return (
        f"On a GPU the law holds the same: on an {runs[0]['device']}, `HFPolicy` sampling "
        f"{f32[0]['episodes']:,} and {f32[1]['episodes']:,} multi-turn episodes with a random Qwen3 on CUDA and "
        f"`policy_logprobs` recomputing them there differ by at most {f32[0]['max_abs_diff']:.1e} and "
        f"{f32[1]['max_abs_diff']:.1e} in float32 ({bf16[0]['max_abs_diff']:.1e} and {bf16[1]['max_abs_diff']:.1e} "
        f"in bfloat16: half precision's gap between a decode step and a whole forward pass) "
        f"(`python benchmarks/gpu_law.py --json benchmarks/results/gpu_law.json`; it exits 1 when float32 is "
        f"not under 1e-4)."
    )


def async_claim() -> str:
    """The sentence on asynchronous GRPO (README and docs/async.md), from ``benchmarks/async_rl.py --json``'s stored run."""
    d = json.loads((RESULTS / "async_rl.json").read_text(encoding="utf-8"))
    sync, run = d["runs"]["sync"], d["runs"]["async"]
    words = {0: "no update", 1: "one", 2: "two", 3: "three"}
    missed = ", ".join(f"{n} missed {words.get(int(k), k)}" for k, n in run["staleness"].items())
    return (
        f"On {d['cpus']} CPU cores, {d['iterations']} GRPO iterations of {d['episodes_per_update']} SmolLM2 episodes "
        f"each way from the same weights, the asynchronous loop (`max_staleness={d['max_staleness']}`, "
        f"`on_update=\"{d['on_update']}\"`) took {run['loop_s']:.0f} s against {sync['loop_s']:.0f} s synchronously "
        f"({d['sync_over_async']:.2f}x; the sampler and the trainer share the cores), training reward "
        f"{run['reward_first']:.2f} -> {run['reward_last']:.2f} against {sync['reward_first']:.2f} -> "
        f"{sync['reward_last']:.2f} (first 3 -> last 3 iterations) and held-out accuracy {run['held_out_before']:.2f} "
        f"-> {run['held_out_after']:.2f} against {sync['held_out_before']:.2f} -> {sync['held_out_after']:.2f}; "
        f"of its {sum(run['staleness'].values())} trained-on episodes {missed}, "
        f"{run['rows_spanning_versions']} rows span two versions, and the tokens the trained weights sampled were "
        f"scored back to within {run['fresh_logprob_diff']:.1e} "
        f"(`python benchmarks/async_rl.py --json benchmarks/results/async_rl.json`)."
    )


def kills_claim() -> str:
    """docs/sandboxes.md's sentence on what killed runs leave, from ``benchmarks/sandbox_kills.py --json``."""
    runs = json.loads((RESULTS / "sandbox_kills.json").read_text(encoding="utf-8"))
    parts = []
    for r in runs:
        left = ", ".join(f"{v} {k}" for k, v in r["after_next_run"].items())
        parts.append(f"{r['backend']}: {r['sandboxes_made']} sandboxes in {r['kills']} SIGKILLed runs, {left} left after the next run")
    return (
        "Measured (`python benchmarks/sandbox_kills.py --json benchmarks/results/sandbox_kills.json`): "
        + "; ".join(parts) + "."
    )


def test_the_sandbox_docs_quote_the_stored_kill_run():
    expected = kills_claim()
    doc = re.sub(r"\s+", " ", (ROOT / "docs" / "sandboxes.md").read_text(encoding="utf-8"))
    assert expected in doc, f"docs/sandboxes.md should say (from the stored output):\n{expected}"


def test_the_async_docs_quote_the_stored_run():
    expected = async_claim()
    doc = re.sub(r"\s+", " ", (ROOT / "docs" / "async.md").read_text(encoding="utf-8"))
    assert expected in doc, f"docs/async.md should say (from the stored output):\n{expected}"


@pytest.mark.parametrize(
    "claim",
    [learn_claim, observation_claim, scale_claim, pool_claim, collate_claim, gpu_claim, learning_claim,
     tool_learning_claim, async_claim],
    ids=lambda f: f.__name__,
)
def test_the_readme_quotes_the_stored_run(claim):
    expected = claim()
    assert expected in _readme(), f"README.md should say (from the stored output):\n{expected}"


def test_a_changed_number_is_caught(monkeypatch):
    readme = _readme()
    expected = observation_claim()
    changed = re.sub(r"is (\d+)x faster", lambda m: f"is {int(m.group(1)) + 1}x faster", expected)
    assert changed != expected and changed not in readme


# ------------------------------------------------------------- the claims table
CLAIMS = ROOT / "docs" / "claims.md"


def readme_claim_sentences(text: str) -> list[str]:
    """The README's prose sentences that state a number: code blocks, tables, headings, HTML
    comments, inline code and link targets are left out; a number is a digit not glued to a word
    (``Qwen3``, ``v0``), a path or a version's dot (``Llama 3.1`` counts once, by its 3)."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith(("|", "#"))]
    prose = re.sub(r"\s+", " ", " ".join(lines))
    found = []
    for sentence in re.split(r"(?<=[.;:!?])\s+(?=[A-Z(`*\"])", prose):
        bare = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", " ", sentence))
        if re.search(r"(?<![\w.\-/])\d", bare):
            found.append(sentence.strip())
    return found


def claims_rows() -> list[tuple[str, str]]:
    """docs/claims.md's rows: (the README's words, what holds them)."""
    rows = []
    for line in CLAIMS.read_text(encoding="utf-8").splitlines():
        m = re.match(r'\| "((?:[^"\\]|\\.)*)" \| (.*) \|$', line)
        if m:
            rows.append((m.group(1).replace('\\"', '"').replace("\\|", "|"), m.group(2)))
    return rows


def test_every_quote_of_the_claims_table_is_in_the_readme():
    rows = claims_rows()
    assert len(rows) > 50
    stale = [quote for quote, _ in rows if quote not in _readme()]
    assert not stale, f"docs/claims.md quotes words the README no longer has: {stale}"


def test_every_readme_sentence_with_a_number_has_a_row():
    quotes = [quote for quote, _ in claims_rows()]
    sentences = readme_claim_sentences(_documents_text())
    assert len(sentences) > 30
    bare = [s for s in sentences if not any(q in s for q in quotes)]
    assert not bare, "README sentences with a number that docs/claims.md does not hold:\n" + "\n".join(bare)


def test_the_sentence_finder_sees_numbers_not_names():
    found = readme_claim_sentences("Qwen3 and `v0` only. It took 3 s. Llama 3.1 works. See [x](a/b2.md) now.\n\n```\n5 s\n```")
    assert found == ["It took 3 s.", "Llama 3.1 works."]


def test_every_test_and_script_the_claims_table_names_exists():
    named = " ".join(held for _, held in claims_rows())
    tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", named)
    files = re.findall(r"`((?:tests|benchmarks)/[\w/]+\.py)[` ]", named) + [f for f, _ in tests]
    assert len(tests) > 60
    missing = [f for f in files if not (ROOT / f).is_file()]
    missing += [f"{f}::{name}" for f, name in tests
                if (ROOT / f).is_file() and not re.search(rf"^(async )?def {name}\(", (ROOT / f).read_text(encoding="utf-8"), re.M)]
    assert not missing, f"docs/claims.md names tests or scripts that do not exist: {missing}"


def test_the_readmes_defaults_are_the_codes():
    """The defaults the README states in words: 1 s of group commit, 5 s for a step under way at a
    stop, 3 s for the hub to answer."""
    import inspect

    from tokengym.envs.tokenizers import HUB_PROBE_TIMEOUT_S
    from tokengym.recorder import TrajectoryWriter
    from tokengym.recorder.drivers.step_pool import STOP_GRACE_S

    assert inspect.signature(TrajectoryWriter).parameters["fsync_interval"].default == 1.0
    assert STOP_GRACE_S == 5.0
    assert HUB_PROBE_TIMEOUT_S == 3.0
    readme = _readme()
    for words in ("`fsync_interval`, 1 s by default", "a step under way gets 5 s", "does not answer within 3 s"):
        assert words in readme
