"""The tokengym command line on the real templates."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokengym.envs import example_transcript
from tokengym.recorder.cli import main
from needs import SMOLLM2_MISSING, needs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "envs" / "data" / "example_transcript.json"


def test_check_template_passes_on_both_real_templates(tokenizer_name, capsys):
    # Qwen2.5 is prefix-stable on the example; Qwen3 drops earlier reasoning: exit 1, cause named.
    code = main(["check-template", tokenizer_name, "--conversation", str(EXAMPLE)])
    out = capsys.readouterr().out
    assert out.count("\n") >= 8 and "0 mismatch" in out
    # A row per turn, each compared with the template (no turn left to a later check).
    assert "5 turns:" in out and "deferred" not in out
    if tokenizer_name == "qwen3":
        assert code == 1
        assert "reasoning_dropped" in out and "known template behaviour" in out
        assert "not prefix-stable on turn(s) [2, 3, 4]" in out and "reasoning is dropped from earlier" in out
    else:
        assert code == 0 and "not prefix-stable" not in out


def test_check_template_fails_on_a_non_conforming_template(tmp_path, capsys):
    template = tmp_path / "t.jinja"
    template.write_text(
        "<|im_start|>system\n{{ messages | length }}<|im_end|>\n"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    msgs = [m for m in example_transcript()["messages"] if m["role"] in ("user", "assistant") and not m.get("tool_calls")]
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps(msgs))
    assert main(["check-template", "qwen2.5", "--conversation", str(conv), "--chat-template", str(template)]) == 3
    assert "mismatch" in capsys.readouterr().out


def test_check_template_with_separate_tools_and_kwargs(tmp_path, capsys):
    t = example_transcript()
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in t["messages"]]
    (tmp_path / "conv.json").write_text(json.dumps(plain))
    (tmp_path / "tools.json").write_text(json.dumps(t["tools"]))
    code = main([
        "check-template", "qwen3", "--conversation", str(tmp_path / "conv.json"),
        "--tools", str(tmp_path / "tools.json"), "--template-kwarg", "enable_thinking=false",
    ])
    assert code == 1  # not prefix-stable: the empty think block of the generation prompt is dropped
    out = capsys.readouterr().out
    assert "empty_think_dropped" in out and "0 mismatch" in out
    # The same transcript with reasoning cannot follow a generation prompt that closed the think block.
    (tmp_path / "conv.json").write_text(json.dumps(t["messages"]))
    code = main([
        "check-template", "qwen3", "--conversation", str(tmp_path / "conv.json"), "--template-kwarg", "enable_thinking=false",
    ])
    assert code == 2 and "reasoning_content" in capsys.readouterr().err


@pytest.mark.parametrize("content, match", [("{not json", "not valid JSON"), ("[]", "non-empty"), ('[{"role": "user", "content": "x"}]', "assistant")])
def test_check_template_bad_input_is_a_clear_error(tmp_path, capsys, content, match):
    conv = tmp_path / "conv.json"
    conv.write_text(content)
    assert main(["check-template", "qwen2.5", "--conversation", str(conv)]) == 2
    assert match in capsys.readouterr().err


def _broken(mutate) -> list[dict]:
    messages = example_transcript()["messages"]
    mutate(messages)
    return messages


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: m[2].update(role="asistant"), r'message 2: unknown role \'asistant\'; did you mean "assistant"'),
        (lambda m: m[1].update(role=None), r"message 1: unknown role None; a role is one of system,"),
        (
            lambda m: m[2]["tool_calls"][1]["function"].update(arguments='{"city": "Berlin"'),
            r"message 2: the arguments of tool call 1 \(get_weather\) are not valid JSON",
        ),
        (
            lambda m: m[2]["tool_calls"][0]["function"].update(arguments="[1, 2]"),
            r"message 2: the arguments of tool call 0 \(get_weather\) are list, not an object",
        ),
        (lambda m: m[2].update(tool_call=m[2].pop("tool_calls")), r'message 2: unknown key \'tool_call\'; did you mean "tool_calls"'),
        (lambda m: m[3].update(tool_calls=[]), r"message 3: a tool message has tool_calls"),
        (  # a call whose result is missing: the next message is another assistant turn
            lambda m: m.__setitem__(slice(3, None), [{"role": "assistant", "content": "Done."}]),
            r"message 3 \(assistant\): message 2 \(assistant\) made 2 tool calls and no result follows it; put the results",
        ),
        (lambda m: m[2].update(tool_calls={"name": "x"}), r"message 2: tool_calls is dict; write a list"),
        (lambda m: m[1].update(content=5), r"message 1: content is int"),
        # A known role that Qwen2.5's template skips: found by the render, not by the names.
        (lambda m: m[0].update(role="developer"), r"message 0 \(developer\): the chat template leaves its text out"),
    ],
)
def test_check_template_refuses_a_broken_transcript_naming_the_message(tmp_path, capsys, mutate, match):
    """Templates skip roles they do not render and read missing keys as empty: these used to pass, or
    fail without an index."""
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps(_broken(mutate)))
    assert main(["check-template", "qwen2.5", "--conversation", str(conv)]) == 2
    captured = capsys.readouterr()
    assert re.search(match, captured.err) and "turn" not in captured.out


@pytest.mark.parametrize(
    "role, when, index", [("tool", "m.role == 'tool'", 3), ("assistant", "m.reasoning_content is defined", 2)]
)
def test_check_template_names_the_message_a_template_error_comes_from(tmp_path, capsys, role, when, index):
    """A template that reads a key some messages lack fails on the first such message (the prompt's
    observation, or an assistant turn rendered as the reference action), by index."""
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }} {% endfor %}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        f"{{% if {when} %}}{{{{ m.meta.source }}}}{{% endif %}}<|im_end|>\n{{% endfor %}}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    code = main(["check-template", "qwen2.5", "--conversation", str(EXAMPLE), "--chat-template", str(template)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"error: message {index} ({role}): the chat template failed to render" in err and "'meta'" in err


def test_demo_and_envs_as_a_user_runs_them(tmp_path):
    out = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "tokengym.recorder.cli", "demo", "--replay", "--out", str(out), "--no-color"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "605 tokens" in proc.stdout and "5 turns" in proc.stdout
    # The default schedule leaves turn 2 to a later check, and the table says what that means.
    assert "deferred: not compared with the template on that turn" in proc.stdout
    rows = [json.loads(line) for line in (out / "replay.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and len(rows[0]["token_ids"]) == len(rows[0]["mask"]) == 605
    envs = subprocess.run([sys.executable, "-m", "tokengym.recorder.cli", "envs"], capture_output=True, text=True)
    assert "tokengym/Replay-v0" in envs.stdout


def test_demo_replay_writes_to_its_own_folder_not_the_demo_store(tmp_path, monkeypatch, capsys):
    """``demo --replay`` appends JSON Lines: in the demo's Parquet store folder they would sit among its shards."""
    from tokengym.recorder.cli.demo import DEMO_OUT, DEMO_REPLAY_OUT

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--replay", "--no-color"]) == 0
    assert f"appended to {Path(DEMO_REPLAY_OUT) / 'replay.jsonl'}" in capsys.readouterr().out
    assert DEMO_REPLAY_OUT != DEMO_OUT and not (tmp_path / DEMO_OUT).exists()
    rows = (tmp_path / DEMO_REPLAY_OUT / "replay.jsonl").read_text().splitlines()
    assert len(rows) == 1 and len(json.loads(rows[0])["token_ids"]) == 605


@pytest.mark.slow
def test_demo_runs_smollm2_on_calculator(tmp_path):
    needs("SMOLLM2", SMOLLM2_MISSING)
    from tokengym.recorder import read_trajectories

    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "tokengym.recorder.cli", "demo", "--episodes", "2", "--max-tokens", "24",
         "--max-turns", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 done, 0 failed" in proc.stdout and "tokengym inspect" in proc.stdout
    assert "chat template: tokengym.envs.templates.CHATML_TOOLS (tokengym/Calculator-v0 has tools" in proc.stdout
    trajs = list(read_trajectories(out))
    assert len(trajs) == 2 and all(t.has_logprobs and t.env_id == "tokengym/Calculator-v0" for t in trajs)
    assert all(t.sampling["policy"].startswith("hf:") and t.sampling["logprob_kind"] == "raw" for t in trajs)



@pytest.mark.slow
def test_demo_model_makes_a_real_tool_call(tmp_path):
    """The demo's own setup (defaults, fixed seed) with the bundled model: the model's call is
    parsed, run, and its result is what the model reads next."""
    needs("SMOLLM2", SMOLLM2_MISSING)
    from tokengym.envs import load_tokenizer
    from tokengym.recorder import read_trajectories
    from tokengym.recorder.turnlog import tool_call_counts

    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "tokengym.recorder.cli", "demo", "--episodes", "2", "--concurrency", "2",
         "--seed", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    trajs = list(read_trajectories(out))
    counts = tool_call_counts(trajs)
    assert counts["valid"] >= 1 and counts["ok"] >= 1, counts
    tok = load_tokenizer("SmolLM2-135M-Instruct")
    called = [t for t in trajs if t.metadata["tool_stats"]["ok"]]
    for t in called:
        first_obs = next(s for s in t.segments if s.kind.value == "observation" and s.turn == 0)
        result = tok.decode(first_obs.token_ids.tolist())
        assert "<tool_response>" in result and t.num_turns >= 2
    # The per-turn lines name the call and its result; the summary says what the reward means.
    assert re.search(r"seed \d+ turn 0: \d+ tokens, calculate\(expression='[^']+'\) -> ", proc.stdout)
    assert "reward        1 when the final turn's <answer>N</answer> is the right number" in proc.stdout
    assert re.search(rf"tool calls +{counts['calls']} in {counts['episodes']} episodes: {counts['valid']} valid \(ok {counts['ok']}, ", proc.stdout)

def test_rollout_with_a_scripted_policy(tmp_path, capsys):
    from tokengym.recorder import read_trajectories

    out = tmp_path / "store"
    code = main([
        "rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--tokenizer", "qwen2.5",
        "--reply", '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
        "--reply", "<answer>5</answer>", "--episodes", "2", "--out", str(out), "--quiet",
    ])
    assert code == 0 and "2 done, 0 failed" in capsys.readouterr().out
    trajs = list(read_trajectories(out))
    assert [t.num_turns for t in trajs] == [2, 2]
    assert all(t.metadata["tool_stats"]["calls"] == 1 for t in trajs)
    assert main(["rollout", "tokengym/Calculator-v0", "--policy", "hf", "--tokenizer", "qwen2.5", "--out", str(tmp_path / "x")]) == 2


# ------------------------------------------------- resume, append, refusals, failures, stops
CALC = ["rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--tokenizer", "qwen2.5",
        "--reply", '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
        "--reply", "<answer>5</answer>", "--quiet"]


def stored_episodes(out):
    from tokengym.recorder import read_trajectories

    trajs = list(read_trajectories(out))
    episodes = [t.metadata["episode"] for t in trajs]
    assert len(episodes) == len(set(episodes)), f"an episode was stored twice: {sorted(episodes)}"
    assert all(t.seed == t.metadata["episode"] for t in trajs)  # seed 0 + episode index
    return sorted(episodes)


def test_rollout_on_an_existing_store_resumes_appends_or_refuses(tmp_path, capsys):
    out = str(tmp_path / "store")
    assert main([*CALC, "--episodes", "3", "--out", out]) == 0
    assert "recording 3 episodes" in capsys.readouterr().out and stored_episodes(out) == [0, 1, 2]
    # The same command again: nothing to do, no duplicate.
    assert main([*CALC, "--episodes", "3", "--out", out]) == 0
    assert "already holds all 3 episodes of this run; nothing to run" in capsys.readouterr().out
    assert stored_episodes(out) == [0, 1, 2]
    # A longer run continues with the same seeds.
    assert main([*CALC, "--episodes", "5", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "resuming" in text and "3 of 5 episodes already stored; running the other 2 (episodes 3-4, same seeds)" in text
    assert "2 done, 0 failed" in text and stored_episodes(out) == [0, 1, 2, 3, 4]
    # --append: new episodes, new seeds.
    assert main([*CALC, "--episodes", "2", "--append", "--out", out]) == 0
    assert "appending 2 new episodes (5-6, new seeds)" in capsys.readouterr().out
    assert stored_episodes(out) == list(range(7))
    # Other settings are refused, the difference named; nothing is written.
    for extra, named in (
        (["--temperature", "0.5"], "sampling.temperature: stored 1.0, asked 0.5"),
        (["--max-turns", "3"], "env_kwargs.max_turns: stored '(unset)', asked 3"),  # the env's own default
        (["--seed", "1", "--append"], "seed: stored 0, asked 1"),
    ):
        assert main([*CALC, "--episodes", "2", *extra, "--out", out]) == 2
        err = capsys.readouterr().err
        assert "recorded with other run settings" in err and named in err, err
    args = [a if a != "tokengym/Calculator-v0" else "tokengym/KeyValue-v0" for a in CALC]
    assert main([*args, "--episodes", "2", "--out", out]) == 2
    assert "env_id: stored 'tokengym/Calculator-v0', asked 'tokengym/KeyValue-v0'" in capsys.readouterr().err
    assert stored_episodes(out) == list(range(7))


def test_rollout_exits_non_zero_and_lists_failures_when_episodes_fail(tmp_path, capsys):
    import gymnasium as gym

    from test_rollout_stops import FlakyCalculator

    if "tokengym-tests/Flaky-v0" not in gym.registry:
        # (gymnasium's passive env checker breaks on a first reset that raised, so it is off here)
        gym.register("tokengym-tests/Flaky-v0", entry_point=FlakyCalculator, disable_env_checker=True)
    args = [a if a != "tokengym/Calculator-v0" else "tokengym-tests/Flaky-v0" for a in CALC]
    out = str(tmp_path / "store")
    assert main([*args, "--episodes", "8", "--out", out]) == 3
    captured = capsys.readouterr()
    assert "4 done, 4 failed" in captured.out
    assert "2 × RuntimeError (episodes 1, 4); first: episode " in captured.out
    assert "2 × ValueError (episodes 2, 7); first: episode " in captured.out
    assert "4 of 8 episodes failed" in captured.err
    # Running it again retries exactly the failed episodes, with their seeds (they fail again).
    assert main([*args, "--episodes", "8", "--out", out]) == 3
    assert "running the other 4 (episodes 1-2, 4, 7, same seeds)" in capsys.readouterr().out
    assert stored_episodes(out) == [0, 3, 5, 6]


def signal_when_stored(cmd, out, episodes, signum):
    """Run ``cmd``, send it ``signum`` once ``out`` holds ``episodes`` episodes; (process, stdout, stderr)."""
    import time

    from tokengym.recorder.store import store_counts

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out.exists() and sum(store_counts(out)[k] for k in ("shard_rows", "log_rows")) >= episodes):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no episode was stored in time"
            time.sleep(0.05)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc, stdout, stderr


@pytest.mark.slow
def test_a_stopped_run_of_the_hf_policy_exits_130_not_an_abort(qwen25, tmp_path):
    """The HF policy decodes on a thread of its own; a Ctrl-C while requests are decoding used to
    leave it inside torch at exit: ``terminate called without an active exception``, exit 134.
    (SIGTERM takes the same path: the test below sends it to the scripted policy.)"""
    import signal

    from tiny_qwen3 import save_tiny_qwen3

    model_dir, _ = save_tiny_qwen3(qwen25, tmp_path / "model")
    out = tmp_path / "store"
    cmd = [sys.executable, "-m", "tokengym.recorder.cli", "rollout", "tokengym/Calculator-v0", "--model", str(model_dir),
           "--episodes", "200", "--concurrency", "4", "--max-turns", "1", "--max-tokens", "400", "--quiet",
           "--out", str(out)]
    # Stopped once two episodes are stored, while the other requests are mid-decode (400 tokens each).
    proc, stdout, stderr = signal_when_stored(cmd, out, 2, signal.SIGINT)
    assert proc.returncode == 130 and "terminate called" not in stderr, stderr[-3000:]
    assert "interrupted: " in stdout and "run the same command again to continue" in stdout
    assert len(stored_episodes(out)) >= 2


@pytest.mark.slow
def test_sigterm_stops_the_cli_cleanly_and_the_same_command_continues(tmp_path, capsys):
    import signal

    out = tmp_path / "store"
    cmd = [sys.executable, "-m", "tokengym.recorder.cli", *CALC, "--episodes", "5000", "--concurrency", "2", "--out", str(out)]
    proc, stdout, stderr = signal_when_stored(cmd, out, 4, signal.SIGTERM)
    assert proc.returncode == 130, stderr[-3000:]
    match = re.search(r"interrupted: (\d+) finished, (\d+) not run", stdout)
    assert match, stdout
    finished, not_run = int(match.group(1)), int(match.group(2))
    stored = stored_episodes(out)
    assert finished == len(stored) >= 4 and finished + not_run == 5000
    assert "run the same command again to continue" in stdout
    # The same store, a shorter run: what is missing below finished + 2 runs, nothing twice.
    assert main([*CALC, "--episodes", str(finished + 2), "--concurrency", "2", "--out", str(out)]) == 0
    assert "resuming" in capsys.readouterr().out
    assert stored_episodes(out) == list(range(finished + 2))


def test_every_option_of_every_command_has_help_and_shows_its_default(capsys):
    """``--help`` documents every option, with its default where it has one."""
    from tokengym.recorder.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction)]
    for name, command in sub.choices.items():
        assert command.description or sub._choices_actions, name
        for action in command._actions:
            if action.dest == "help":
                continue
            assert action.help, f"tokengym {name} {'/'.join(action.option_strings) or action.dest} has no help"
        text = "".join(command.format_help().split())  # wrapped lines may split a value at a hyphen
        for action in command._actions:
            if action.option_strings and action.default not in (None, [], False, __import__("argparse").SUPPRESS):
                assert f"(default:{action.default})" in text, (name, action.dest)
        assert "(default:None)" not in text and "(default:[])" not in text
    assert {a.dest for a in sub._choices_actions} == set(sub.choices)  # every command has a one-line help


def test_envs_lists_whole_first_sentences(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    replay = next(line for line in out.splitlines() if line.startswith("tokengym/Replay-v0"))
    assert replay.rstrip().endswith(".") and "first assistant message; each step" in replay


# ------------------------------------------------- the demo says which chat template it applies
@pytest.mark.parametrize("own_template", [True, False], ids=["own-template", "no-template"])
def test_demo_says_which_chat_template_it_applies(own_template, qwen25, tmp_path, capsys):
    """One line before the episodes: the model's own template, or CHATML_TOOLS where its tokenizer has none."""
    import copy

    from tiny_qwen3 import save_tiny_qwen3

    from tokengym.envs.templates import CHATML_TOOLS
    from tokengym.recorder import read_trajectories

    tok = copy.deepcopy(qwen25)
    if not own_template:
        tok.chat_template = None
    model_dir, _ = save_tiny_qwen3(tok, tmp_path / "model")
    out = tmp_path / "demo"
    code = main([
        "demo", "--model", str(model_dir), "--episodes", "1", "--concurrency", "1", "--max-tokens", "4",
        "--max-turns", "1", "--few-shot", "0", "--out", str(out),
    ])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    said = [line for line in lines if line.startswith("chat template: ")]
    assert len(said) == 1 and lines.index(said[0]) < next(i for i, x in enumerate(lines) if x.startswith("Running"))
    (traj,) = read_trajectories(out)

    def prompt(**kwargs):  # the same episode's prompt, rendered by an env made here
        import gymnasium as gym

        env = gym.make("tokengym/Calculator-v0", tokenizer=tok, max_turns=1, few_shot=0, **kwargs)
        return env.reset(seed=traj.seed)[0].tolist()

    recorded = traj.token_ids[: traj.prompt_len].tolist()
    if own_template:
        assert said[0] == f"chat template: {model_dir}'s own (from its tokenizer)"
        assert recorded == prompt()
    else:
        assert said[0] == f"chat template: tokengym.envs.templates.CHATML_TOOLS (the tokenizer of {model_dir} has none)"
        assert recorded == prompt(chat_template=CHATML_TOOLS)


def test_demo_never_appends_to_a_store_of_other_settings(qwen25, tmp_path, monkeypatch, capsys):
    """A rerun with the same settings adds new episodes (new seeds, never a second copy); one with
    other settings goes to the next free folder, or with ``--out`` is refused before a model loads."""
    from tiny_qwen3 import save_tiny_qwen3

    from tokengym.recorder import read_trajectories
    from tokengym.recorder.cli.demo import DEMO_OUT

    model_dir, _ = save_tiny_qwen3(qwen25, tmp_path / "model")
    monkeypatch.chdir(tmp_path)

    def demo(*extra):
        argv = ["demo", "--model", str(model_dir), "--episodes", "1", "--concurrency", "1", "--max-turns", "1",
                "--few-shot", "0", *extra]
        code = main(argv)
        return code, capsys.readouterr()

    code, said = demo("--max-tokens", "4")
    assert code == 0 and f"recording 1 episodes to {DEMO_OUT}" in said.out
    code, said = demo("--max-tokens", "4")
    assert code == 0 and f"appending 1 new episodes (1, new seeds) to {DEMO_OUT}, which holds 1" in said.out
    seeds = sorted(t.seed for t in read_trajectories(tmp_path / DEMO_OUT))
    assert len(seeds) == 2 and seeds[0] != seeds[1]

    code, said = demo("--max-tokens", "3")  # other settings: a new folder, said
    assert code == 0 and f"recording 1 episodes to {DEMO_OUT}-2 ({DEMO_OUT} holds a demo with other settings)" in said.out
    assert len(list(read_trajectories(tmp_path / DEMO_OUT))) == 2
    assert len(list(read_trajectories(tmp_path / f"{DEMO_OUT}-2"))) == 1

    code, said = demo("--max-tokens", "5", "--out", DEMO_OUT)  # named: refused, by the setting that differs
    assert code == 2 and "Loading" not in said.out
    assert "sampling.max_tokens: stored 4, asked 5" in said.err and "pass another --out" in said.err
    assert len(list(read_trajectories(tmp_path / DEMO_OUT))) == 2


def test_demo_says_smollm2_gets_the_tool_template_as_rollout_does():
    """The embedded SmolLM2: CHATML_TOOLS, in the very line ``tokengym rollout --model smollm2`` prints."""
    from tokengym.envs.templates import CHATML_TOOLS
    from tokengym.recorder.cli.demo import demo_template
    from tokengym.recorder.drivers.model_setup import env_template

    template, line = demo_template(None, None)
    assert template == CHATML_TOOLS
    assert line == env_template("tokengym/Calculator-v0", "smollm2", {})[1]
    assert line.startswith("chat template: tokengym.envs.templates.CHATML_TOOLS (tokengym/Calculator-v0 has tools")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--env-kwarg", "max_turns=abc"], r"max_turns must be a positive int, got 'abc' \(str\)"),
        (["--env-kwarg", "max_turns=NaN"], r"max_turns must be a positive int, got nan \(float\)"),
        (["--env-kwarg", "max_turns=Infinity"], r"max_turns must be a positive int, got inf \(float\)"),
        (["--env-kwarg", "max_turns=" + "[" * 60000 + "]" * 60000], r"--env-kwarg max_turns: the JSON value is nested too deep"),
    ],
    ids=["text", "nan", "inf", "deep-json"],
)
def test_bad_cli_values_are_named_without_a_traceback(tmp_path, capsys, extra, message):
    code = main([*CALC, "--episodes", "1", "--out", str(tmp_path / "s"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err) and "Traceback" not in err
    assert len(err) < 2000  # the message, not a dump of the tokenizer


@pytest.mark.parametrize(
    "module, source, message",
    [
        ("quits_on_import", "import sys\nsys.exit(0)\n", r"importing 'quits_on_import' to register its envs called sys.exit\(0\)"),
        ("fails_on_import", "raise RuntimeError('no GPU here')\n", r"importing 'fails_on_import' .* RuntimeError: no GPU here"),
    ],
)
def test_a_module_that_exits_or_fails_at_import_is_an_error_not_the_runs_end(tmp_path, capsys, monkeypatch, module, source, message):
    (tmp_path / f"{module}.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = [*CALC, "--episodes", "1", "--out", str(tmp_path / "s")]
    argv[1] = f"{module}:tokengym/Calculator-v0"
    assert main(argv) == 2 and re.search(message, capsys.readouterr().err)
    argv[1] = ".relative:tokengym/Calculator-v0"
    assert main(argv) == 2 and "MODULE:ID takes no leading dot" in capsys.readouterr().err


def test_the_cli_keeps_the_envs_own_max_turns_unless_asked(tmp_path, capsys):
    """Calculator-v0 ends an episode after its own max_turns (6); the CLI no longer passes a
    default of its own, and --max-turns still wins when given."""
    import gymnasium as gym

    from tokengym.recorder import read_trajectories

    calls = ['<tool_call>\n{"name": "calculate", "arguments": {"expression": "1 + 1"}}\n</tool_call>'] * 20
    base = [a for a in CALC if a not in ("--reply",) and not a.startswith(("<tool_call>", "<answer>"))]
    replies = [x for c in calls for x in ("--reply", c)]
    assert main([*base, *replies, "--episodes", "1", "--out", str(tmp_path / "own")]) == 0
    own = gym.make("tokengym/Calculator-v0", tokenizer="qwen2.5").unwrapped.max_turns
    (traj,) = read_trajectories(tmp_path / "own")
    assert traj.stop_reason == "max_turns" and traj.num_turns == own
    assert main([*base, *replies, "--episodes", "1", "--max-turns", "3", "--out", str(tmp_path / "three")]) == 0
    (traj,) = read_trajectories(tmp_path / "three")
    assert traj.stop_reason == "max_turns" and traj.num_turns == 3
    capsys.readouterr()


def test_a_run_that_failed_before_its_first_episode_does_not_lock_its_store(tmp_path, capsys):
    """A typo in an env argument fails the run before any episode; the corrected run takes the
    empty store over, said, instead of being refused as 'other run settings'."""
    from tokengym.recorder import read_trajectories

    out = str(tmp_path / "store")
    assert main([*CALC, "--episodes", "2", "--out", out, "--env-kwarg", "max_turn=3"]) == 2
    assert "did you mean 'max_turns'?" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="holds no episode; its run settings .* are replaced by this run's"):
        assert main([*CALC, "--episodes", "2", "--out", out]) == 0
    assert len(list(read_trajectories(out))) == 2
    assert main([*CALC, "--episodes", "2", "--temperature", "0.5", "--out", out]) == 2  # now it holds episodes
    assert "recorded with other run settings" in capsys.readouterr().err


def test_an_entry_point_whose_module_is_missing_is_an_error_that_names_it(tmp_path, capsys, monkeypatch):
    """Not a raw traceback (exit 1): the entry point, the missing module and the fix, exit 2."""
    (tmp_path / "broken_entry.py").write_text(
        "import gymnasium as gym\n"
        "gym.register('tokengym-tests/BrokenEntry-v0', entry_point='no_such_package_here.envs:Env')\n"
    )
    monkeypatch.chdir(tmp_path)
    code = main(["rollout", "broken_entry:tokengym-tests/BrokenEntry-v0", "--policy", "scripted", "--reply", "hi",
                 "--tokenizer", "qwen2.5", "--episodes", "1", "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert ("its entry point 'no_such_package_here.envs:Env' does not load (ModuleNotFoundError: No module named "
            "'no_such_package_here'); install the package that provides 'no_such_package_here.envs'") in err


def test_a_near_miss_of_the_bundled_models_name_is_named(tmp_path, capsys):
    from tokengym.policies.model_loading import resolve_model

    assert main(["rollout", "tokengym/Calculator-v0", "--model", "smolm2", "--episodes", "1",
                 "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'smolm2': did you mean 'smollm2'?" in err and "tokenizer" not in err
    assert not resolve_model("Qwen/Qwen3-0.6B").bundled  # a hub name is not second-guessed
    with pytest.raises(ValueError, match="did you mean 'smollm2-135m-instruct'"):
        resolve_model("SmolLM2-135M-Instruc")


def test_quiet_leaves_out_the_model_and_template_lines_and_every_bar(tmp_path, capsys, monkeypatch):
    import tokengym.recorder.cli.rollout as cli_rollout

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    seen = []
    real = cli_rollout._rollout
    monkeypatch.setattr(cli_rollout, "_rollout", lambda args: seen.append(os.environ.get("TQDM_DISABLE")) or real(args))
    loud_args = [a for a in CALC if a != "--quiet"]
    assert main([*loud_args, "--episodes", "2", "--out", str(tmp_path / "loud")]) == 0
    assert main([*CALC, "--episodes", "2", "--out", str(tmp_path / "quiet")]) == 0
    assert seen == [None, "1"] and "TQDM_DISABLE" not in os.environ  # bars off for the quiet command only
    out = capsys.readouterr().out
    assert out.count("recording 2 episodes to") == 2  # the store's plan is said either way


def test_deadline_flags_are_checked(tmp_path, capsys):
    out = str(tmp_path / "store")
    assert main([*CALC, "--step-timeout", "nan", "--out", out]) == 2
    assert "--step-timeout must be a number of seconds >= 0 (0: no limit), got nan" in capsys.readouterr().err
    assert main([*CALC, "--turn-timeout", "-1", "--out", out]) == 2
    assert "--turn-timeout must be a number of seconds >= 0" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()  # refused before any store was made
