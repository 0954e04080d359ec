"""Images in the token stream, on real parts: the Qwen3 tokenizer with Qwen3.5's own chat template
from the pinned corpus (it renders image parts), transformers' own Qwen2-VL image processor, and
a tiny random Qwen2-VL built from a config (its vision tower and M-RoPE are the real model's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from PIL import Image

from tiny_qwen2_vl import tiny_qwen2_vl
from tokengym.envs import ToolEnv
from tokengym.envs.builtin.dots import DotCountEnv, draw_dots
from tokengym.envs.chat import ChatEnv, EnvResponse, Prompt
from tokengym.envs.images import ImageTokenMismatch, Qwen2VLVision, StreamImage, load_image
from tokengym.envs.template_corpus import corpus_tokenizer
from tokengym.policies import Generation, HFVisionPolicy, SamplingParams, ScriptedPolicy
from tokengym.policies.base import context_images
from tokengym.recorder import RecordEpisodes, rollout

NO_THINK = {"enable_thinking": False}
ZOOM = (
    "<tool_call>\n<function=zoom>\n<parameter=x>\n{x}\n</parameter>\n<parameter=y>\n10\n</parameter>\n"
    "<parameter=width>\n40\n</parameter>\n<parameter=height>\n40\n</parameter>\n</function>\n</tool_call><|im_end|>"
)


@pytest.fixture(scope="module")
def vl_tok():
    tok, _ = corpus_tokenizer("Qwen3.5-4B")
    return tok


@pytest.fixture(scope="module")
def vision(vl_tok):
    return Qwen2VLVision(vl_tok, min_pixels=56 * 56, max_pixels=112 * 112)


@pytest.fixture(scope="module")
def vlm(vl_tok):
    return tiny_qwen2_vl(vl_tok)


def picture(seed: int, h: int = 60, w: int = 90) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def ids_of(tok, text: str) -> np.ndarray:
    return np.array(tok.encode(text, add_special_tokens=False))


class Look(ChatEnv):
    """A user shows a picture with a question; each turn the user shows another."""

    def make_prompt(self, options):
        return Prompt([{"role": "user", "content": [
            {"type": "text", "text": "What is this? <|im_end|>"}, {"type": "image", "image": picture(1)},
        ]}])

    def respond(self, turn):
        return EnvResponse([{"role": "user", "content": [
            {"type": "image", "image": picture(turn.turn + 2, 56, 56)}, {"type": "text", "text": "And this?"},
        ]}])


# ------------------------------------------------------------------ the env side
def test_an_image_stands_as_the_processors_count_of_placeholders(vl_tok, vision):
    env = Look(vl_tok, vision=vision, max_turns=3, template_kwargs=NO_THINK)
    obs, info = env.reset(seed=0)
    (img,) = info["images"]
    want = vision.features(picture(1))
    assert img.features.grid_thw == want.grid_thw and img.num_tokens == want.num_tokens == np.prod(want.grid_thw) // 4
    pad = vision.placeholder_id
    assert obs[img.offset : img.offset + img.num_tokens].tolist() == [pad] * img.num_tokens
    assert int(np.sum(obs == pad)) == img.num_tokens
    assert obs[img.offset - 1] == vl_tok.convert_tokens_to_ids("<|vision_start|>")
    # the user's "<|im_end|>" is text from the env, not a control token, inside content parts too
    assert int(np.sum(obs == vl_tok.convert_tokens_to_ids("<|im_end|>"))) == 1

    obs2, _, _, _, info2 = env.step(ids_of(vl_tok, "A picture.<|im_end|>"))
    (img2,) = info2["images"]
    assert img2.turn == 0 and img2.index == 1 and img2.source == "observation"
    start = env.num_tokens - len(obs2)
    assert img2.offset - start >= 0 and obs2[img2.offset - start : img2.offset - start + img2.num_tokens].tolist() == [pad] * img2.num_tokens
    assert info2["conformance"].status in ("ok", "known")  # the whole render writes one placeholder per image too


def test_an_image_env_passes_gymnasiums_checker(vl_tok, vision):
    check_env(Look(vl_tok, vision=vision, max_turns=3, template_kwargs=NO_THINK), skip_render_check=True)


def test_an_image_without_a_vision_processor_is_an_error_that_names_the_fix(vl_tok):
    with pytest.raises(ValueError, match=r"1 image part\(s\).*no vision processor: pass vision=Qwen2VLVision"):
        Look(vl_tok, max_turns=2).reset(seed=0)


def test_a_template_that_drops_images_is_refused_when_the_env_is_built(vision):
    tok, _ = corpus_tokenizer("HuggingFaceTB-SmolLM3-3B")  # renders the text parts of a message, not its images
    with pytest.raises(ValueError, match=r"writes one image placeholder \(id 151655\) per image part; this one writes 0"):
        Look(tok, vision=vision, max_turns=2)
    qwen3 = corpus_tokenizer("Qwen-Qwen3-0.6B")[0]  # cannot render content parts at all
    with pytest.raises(ValueError, match=r"cannot render a user message with one"):
        Look(qwen3, vision=vision, max_turns=2)


def test_placeholders_that_disagree_with_the_images_name_the_turn(vision):
    from tokengym.envs.images import expand_images

    f = vision.features(picture(1))
    pad = vision.placeholder_id
    ids, offsets = expand_images([7, pad, 8, pad, 9], [f, f], pad, turn=2)
    assert offsets == [1, 2 + f.num_tokens] and ids.count(pad) == 2 * f.num_tokens and ids[-1] == 9
    with pytest.raises(ImageTokenMismatch, match=r"turn 3's observation has 2 image\(s\) \(#4..#5\) but the chat template wrote 1"):
        expand_images([7, pad, 8], [f, f], pad, turn=3, first_index=4)


def test_image_parts_take_pil_bytes_paths_and_arrays_and_refuse_the_rest(tmp_path):
    import io

    img = picture(3)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    path = tmp_path / "p.png"
    path.write_bytes(buf.getvalue())
    for value in (img, buf.getvalue(), str(path), path, np.asarray(img)):
        assert np.array_equal(np.asarray(load_image(value)), np.asarray(img))
    for bad, match in ((b"not a png", "not an image PIL can read"), (str(tmp_path / "missing.png"), "not a file"),
                       (np.zeros((4, 4)), r"\(H, W, 3\) uint8"), (3.5, "holds a float")):
        with pytest.raises(ValueError, match=match):
            load_image(bad)


def crop_tool(big):
    def crop(x: int, y: int) -> object:
        """Crop a 56x56 region.

        Args:
            x: left edge
            y: top edge
        """
        return ["the region:", big.crop((x, y, x + 56, y + 56))]

    return crop


class Crops(ToolEnv):
    def task_messages(self, task):
        return [{"role": "user", "content": [{"type": "image", "image": picture(7, 112, 112)}, {"type": "text", "text": "Count."}]}]


def test_a_tool_that_returns_an_image_shows_it_in_the_tool_message(vl_tok, vision):
    env = Crops(vl_tok, tasks=[{"id": "t"}], tools=[crop_tool(picture(7, 112, 112))], vision=vision, max_turns=3,
                template_kwargs=NO_THINK)
    env.reset(seed=0)
    call = "<tool_call>\n<function=crop>\n<parameter=x>\n10\n</parameter>\n<parameter=y>\n20\n</parameter>\n</function>\n</tool_call><|im_end|>"
    obs, _, _, _, info = env.step(ids_of(vl_tok, call))
    (img,) = info["images"]
    assert info["tool_results"][0]["images"] == [[56, 56]] and img.num_tokens == vision.features(img.image).num_tokens
    text = vl_tok.decode(obs)
    assert "<tool_response>\nthe region:<|vision_start|><|image_pad|>" in text
    assert info["conformance"].status in ("ok", "known")


def test_tool_images_count_against_the_turns_budget_and_those_over_it_are_said(vl_tok, vision):
    env = Crops(vl_tok, tasks=[{"id": "t"}], tools=[crop_tool(picture(7, 112, 112))], vision=vision, max_turns=3,
                template_kwargs=NO_THINK, max_turn_result_tokens=64, max_result_tokens=64)
    env.reset(seed=0)
    call = "<tool_call>\n<function=crop>\n<parameter=x>\n10\n</parameter>\n<parameter=y>\n20\n</parameter>\n</function>\n</tool_call>"
    # four calls of one turn: 4 images of 4 tokens each fit in 64 - 4 * 32 (text floors)? no: only what fits is shown
    obs, _, _, _, info = env.step(ids_of(vl_tok, "\n".join([call] * 4) + "<|im_end|>"))
    shown = len(info.get("images", []))
    results = info["tool_results"]
    dropped = [r for r in results if "left out: over this turn's token budget" in r["content"]]
    assert shown + len(dropped) == 4 and dropped, results


def test_a_tool_image_in_a_text_env_is_an_error_that_names_the_fix(vl_tok):
    env = ToolEnv(vl_tok, tasks=[{"id": "t", "prompt": "Count."}], tools=[crop_tool(picture(7, 112, 112))], max_turns=3,
                  template_kwargs=NO_THINK)
    env.reset(seed=0)
    call = "<tool_call>\n<function=crop>\n<parameter=x>\n1\n</parameter>\n<parameter=y>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>"
    with pytest.raises(ValueError, match=r"tool 'crop' returned an image.*no vision processor"):
        env.step(ids_of(vl_tok, call))


# ------------------------------------------------------------------ recorded, and the law
class ZoomFirst:
    """Turn 0 zooms (teacher-forced: its logprobs are the model's for those tokens); later turns sample."""

    sees_images = True
    continuous_batching = False
    logprob_kind = "raw"

    def __init__(self, policy: HFVisionPolicy, tok) -> None:
        self.policy, self.tok, self.name = policy, tok, "zoom-first"

    def generate(self, contexts, params):
        out = []
        for c, p in zip(contexts, params if isinstance(params, list) else [params] * len(contexts)):
            if len(context_images(c)) == 1:  # only the prompt's picture: zoom
                call = self.tok.encode(ZOOM.format(x=5 + len(c) % 20), add_special_tokens=False)
                full = [*c, *call]
                with torch.no_grad():
                    logits = self.policy.model(**self.policy.model_inputs(full, context_images(c))).logits[0].float()
                lp = torch.log_softmax(logits, -1)[torch.arange(len(c) - 1, len(full) - 1), torch.as_tensor(call)]
                out.append(Generation(np.array(call), lp.numpy(), "stop"))
            else:
                out.append(self.policy.generate([c], [p])[0])
        return out


def recomputed(policy: HFVisionPolicy, traj) -> np.ndarray:
    """Teacher-forced logprobs of every token of ``traj`` after the first, with its images."""
    ids = traj.token_ids
    with torch.no_grad():
        logits = policy.model(**policy.model_inputs(ids.tolist(), traj.images)).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.as_tensor(ids[1:])].numpy()


def test_the_law_holds_with_images_in_the_prompt_and_from_a_tool(zoomed):
    policy, trajs = zoomed
    for traj in trajs:
        assert len(traj.images) >= 2 and {i.source for i in traj.images} == {"prompt", "observation"}
        mask = traj.mask[1:].astype(bool)
        assert mask.sum() > 20
        diff = np.abs(recomputed(policy, traj)[mask] - traj.logprobs[1:][mask])
        assert diff.max() < 1e-4, diff.max()


def test_an_image_whose_count_the_model_would_not_make_is_refused_naming_it(vl_tok):
    wrong = Qwen2VLVision(vl_tok, min_pixels=56 * 56, max_pixels=112 * 112, merge_size=1)  # the model merges 2x2
    policy = HFVisionPolicy(tiny_qwen2_vl(vl_tok), vl_tok)
    res = rollout(lambda: DotCountEnv(vl_tok, vision=wrong, max_turns=2, template_kwargs=NO_THINK), policy,
                  episodes=1, sampling=SamplingParams(max_tokens=4), progress=False)
    assert res.stats.failed == 1
    assert "image #0 (the prompt) stands as" in str(res.stats.errors[0]) and "spatial merge 2" in str(res.stats.errors[0])


def test_a_text_policy_refuses_a_context_with_images(vl_tok):
    res = rollout(lambda: DotCountEnv(vl_tok, max_turns=2, template_kwargs=NO_THINK),
                  ScriptedPolicy(lambda c: [vl_tok.convert_tokens_to_ids("<|im_end|>")]), episodes=1, progress=False)
    assert res.stats.failed == 1 and "reads text only" in str(res.stats.errors[0])


def test_a_trajectory_whose_image_runs_disagree_with_its_stream_is_refused(vl_tok, vision):
    rec = RecordEpisodes(Look(vl_tok, vision=vision, max_turns=1, template_kwargs=NO_THINK))
    rec.reset(seed=0)
    *_, info = rec.step(ids_of(vl_tok, "A picture.<|im_end|>"))
    traj = info["trajectory"]
    assert len(traj.images) == 1
    img = traj.images[0]
    moved = StreamImage(img.image, img.features, img.offset + 1, img.turn, img.index, img.placeholder_id)
    with pytest.raises(ImageTokenMismatch, match=r"image #0 \(the prompt\)"):
        type(traj)(segments=traj.segments, images=[moved])


def test_the_dot_env_grades_from_the_seed(vl_tok):
    env = DotCountEnv(vl_tok, max_turns=2, template_kwargs=NO_THINK)
    _, info = env.reset(seed=0, options={"picture_seed": 11})
    picture_11, dots = draw_dots(11)
    assert info["task"]["answer"] == len(dots) and np.array_equal(np.asarray(info["images"][0].image), np.asarray(picture_11))
    _, wrong, *_ = env.step(ids_of(vl_tok, f"<answer>{len(dots) + 1}</answer><|im_end|>"))
    env.reset(seed=0, options={"picture_seed": 11})
    _, right, *_ = env.step(ids_of(vl_tok, f"<answer>{len(dots)}</answer><|im_end|>"))
    assert (right, wrong) == (1.0, 0.0)


@pytest.fixture(scope="module")
def zoomed(vl_tok, vlm):
    """Three recorded episodes of the dot env: the prompt's picture, a zoomed region from the tool, sampled turns."""
    policy = HFVisionPolicy(vlm, vl_tok)
    res = rollout(
        lambda: DotCountEnv(vl_tok, max_turns=3, template_kwargs=NO_THINK), ZoomFirst(policy, vl_tok), episodes=3,
        concurrency=3, sampling=SamplingParams(max_tokens=10, temperature=1.0), seed=2, progress=False,
    )
    assert res.stats.failed == 0, res.stats.errors
    return policy, res.trajectories


def test_the_law_holds_over_the_verl_batch_with_its_images_and_mrope_positions(vl_tok, zoomed):
    from tokengym.policies.hf_vision import mrope_positions
    from tokengym.recorder import to_verl

    policy, trajs = zoomed
    model = policy.model
    P, R = max(tr.prompt_len for tr in trajs) + 3, max(len(tr) - tr.prompt_len for tr in trajs) + 2  # padding on both sides
    b = to_verl(trajs, prompt_length=P, response_length=R, rope_index=mrope_positions(model), pad_token_id=vl_tok.pad_token_id)
    t = b.tensors
    B, W = t["input_ids"].shape
    assert t["position_ids"].shape == (B, 4, W) and not t["attention_mask"].all()  # padded rows
    rows = b.non_tensors["multi_modal_inputs"]
    assert [len(r["image_grid_thw"]) for r in rows] == [len(tr.images) for tr in trajs]
    for r, tr in zip(rows, trajs):  # the recorded features, not a re-run of the processor
        assert torch.equal(r["pixel_values"], torch.from_numpy(np.concatenate([i.features.pixel_values for i in tr.images])))
    inputs = {
        "input_ids": t["input_ids"], "attention_mask": t["attention_mask"], "position_ids": t["position_ids"].permute(1, 0, 2),
        "pixel_values": torch.cat([r["pixel_values"] for r in rows]), "image_grid_thw": torch.cat([r["image_grid_thw"] for r in rows]),
    }
    if policy._token_types:
        inputs["mm_token_type_ids"] = (t["input_ids"] == model.config.image_token_id).long()
    with torch.no_grad():
        lp = torch.log_softmax(model(**inputs).logits.float(), -1)
    got = lp[:, P - 1 : -1].gather(-1, t["input_ids"][:, P:, None])[..., 0]
    mask = t["response_mask"].bool()
    assert mask.sum() > 30 and (got[mask] - t["rollout_log_probs"][mask]).abs().max() < 1e-4
    with pytest.raises(ValueError, match=r"needs the model's multimodal positions, rope_index="):
        to_verl(trajs)
    first_image_end = max(i.offset + i.num_tokens for i in trajs[0].images)
    cut = first_image_end - trajs[0].prompt_len - 2  # through the tool's image
    with pytest.raises(ValueError, match=r"trajectory 0: the cut at response_length leaves .* of image #1"):
        to_verl(trajs[:1], response_length=cut, overlong="truncate", rope_index=mrope_positions(model))


def test_to_trl_refuses_trajectories_with_images_by_name(vl_tok, vision):
    from tokengym.recorder import to_trl

    rec = RecordEpisodes(Look(vl_tok, vision=vision, max_turns=1, template_kwargs=NO_THINK))
    rec.reset(seed=0)
    *_, info = rec.step(ids_of(vl_tok, "A picture.<|im_end|>"))
    with pytest.raises(ValueError, match=r"1 of the 1 trajectories hold images.*to_trl does not carry images"):
        to_trl([info["trajectory"]])


def test_the_law_holds_over_the_packed_batch_row_by_row(vl_tok, zoomed):
    from tokengym.policies.hf_vision import mrope_positions
    from tokengym.recorder import to_packed

    policy, trajs = zoomed
    model = policy.model
    with pytest.raises(ValueError, match=r"to_packed needs the model's multimodal positions"):
        to_packed(trajs)
    b = to_packed(trajs, rope_index=mrope_positions(model))
    mm = b.multi_modal_inputs
    assert b.position_ids.shape == (4, len(b.input_ids)) and mm["images_per_row"].tolist() == [len(t.images) for t in trajs]
    cu, first = b.cu_seqlens.tolist(), 0
    for i, (a, z) in enumerate(zip(cu[:-1], cu[1:])):  # each row as a varlen kernel sees it: its own slice
        k = int(mm["images_per_row"][i])
        grid = mm["image_grid_thw"][first : first + k]
        patches = int(mm["image_grid_thw"][:first].prod(-1).sum()), int(mm["image_grid_thw"][: first + k].prod(-1).sum())
        ids = b.input_ids[a:z][None]
        inputs = {"input_ids": ids, "position_ids": b.position_ids[:, a:z][:, None], "image_grid_thw": grid,
                  "pixel_values": mm["pixel_values"][patches[0] : patches[1]]}
        if policy._token_types:
            inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
        with torch.no_grad():
            lp = torch.log_softmax(model(**inputs).logits[0].float(), -1)
        got = lp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        mask = b.loss_mask[a + 1 : z].bool()
        assert mask.any() and (got[mask] - b.logprobs[a + 1 : z][mask]).abs().max() < 1e-4
        first += k


def test_the_store_keeps_each_image_once_and_gives_back_the_same_trajectories(vl_tok, zoomed, tmp_path):
    from tokengym.recorder import TrajectoryWriter, read_table, read_trajectories
    from tokengym.recorder.store.errors import CorruptShardError

    _, trajs = zoomed
    store = tmp_path / "store"
    with TrajectoryWriter(store, tokenizer=vl_tok, shard_size=2) as writer:  # a shard, and a row in the log
        for t in trajs:
            writer.write(t)
    files = sorted((store / "images").glob("*.npz"))
    distinct = {(i.image.tobytes(), i.features.pixel_values.tobytes()) for t in trajs for i in t.images}
    assert len(files) == len(distinct)  # each distinct image once, however many rows show it
    back = list(read_trajectories(store, tokenizer=vl_tok))
    assert len(back) == len(trajs)
    for a, b in zip(trajs, back):
        assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.logprobs, b.logprobs, equal_nan=True)
        assert a.images == b.images  # features, offsets, turns; and the pixels:
        assert all(np.array_equal(np.asarray(x.image), np.asarray(y.image)) for x, y in zip(a.images, b.images))
    stored = read_table(store, columns=["images"]).column("images").to_pylist()
    assert [len(r) for r in stored] == [len(t.images) for t in trajs]
    files[0].write_bytes(files[0].read_bytes()[:-9] + b"corrupted")  # a damaged image file is named
    with pytest.raises(CorruptShardError, match=r"images/[0-9a-f]{64}\.npz"):
        list(read_trajectories(store))
    files[0].unlink()
    with pytest.raises(CorruptShardError, match=r"is missing: images/[0-9a-f]{64}\.npz is not in the store"):
        list(read_trajectories(store))


def test_the_same_image_in_many_rows_is_stored_once(vl_tok, vision, tmp_path):
    from tokengym.recorder import TrajectoryWriter

    rows = []
    for _ in range(4):  # four episodes of the same prompt picture
        rec = RecordEpisodes(Look(vl_tok, vision=vision, max_turns=1, template_kwargs=NO_THINK))
        rec.reset(seed=0)
        *_, info = rec.step(ids_of(vl_tok, "A picture.<|im_end|>"))
        rows.append(info["trajectory"])
    with TrajectoryWriter(tmp_path / "s", tokenizer=vl_tok) as writer:
        for t in rows:
            writer.write(t)
    assert len(list((tmp_path / "s" / "images").glob("*.npz"))) == 1

def test_text_policies_called_directly_refuse_a_context_with_images(vl_tok, vision):
    from tokengym.policies import HFPolicy
    from tokengym.policies.base import VisionContext
    from tiny_qwen3 import tiny_qwen3

    env = Look(vl_tok, vision=vision, max_turns=1, template_kwargs=NO_THINK)
    obs, info = env.reset(seed=0)
    ctx = VisionContext(obs.tolist(), info["images"])
    with pytest.raises(ValueError, match=r"context 0 holds 1 image\(s\), and this policy reads text only"):
        HFPolicy(tiny_qwen3(len(vl_tok)), vl_tok).generate([ctx], SamplingParams(max_tokens=2))


def test_inspect_and_the_html_view_show_each_image_where_it_stands(vl_tok, zoomed, tmp_path):
    from tokengym.recorder.views import render_trajectory_html, render_trajectory_text

    _, trajs = zoomed
    t = trajs[0]
    text = render_trajectory_text(t, vl_tok, color=False, markers=False)
    labels = [f"[image #{i.index}: {i.image.size[0]}x{i.image.size[1]}, {i.num_tokens} tokens]" for i in t.images]
    assert all(label in text for label in labels) and "<|image_pad|>" not in text
    assert text.index(labels[0]) < text.index(labels[1]) and "<|vision_start|>" + labels[0] + "<|vision_end|>" in text
    page = render_trajectory_html(t, vl_tok, document=True)
    assert page.count('<img class="tg-image" src="data:image/png;base64,') == len(t.images)
    assert "http" not in page.split("<body>")[1] and "<script" not in page


@pytest.mark.mcp
def test_an_mcp_servers_image_is_an_image_part_of_the_tool_message(vl_tok, vision):
    import sys
    from pathlib import Path

    from tokengym.envs import MCPTools

    server = MCPTools([sys.executable, str(Path(__file__).with_name("mcp_fault_server.py"))])
    env = ToolEnv(vl_tok, [{"id": "t", "prompt": "Look."}], server, vision=vision, max_turns=2, template_kwargs=NO_THINK)
    try:
        env.reset(seed=0)
        call = "<tool_call>\n<function=pixel>\n</function>\n</tool_call><|im_end|>"
        obs, _, _, _, info = env.step(ids_of(vl_tok, call))
        (img,) = info["images"]
        assert info["tool_results"][0]["content"] == "here:" and info["tool_results"][0]["images"] == [list(img.image.size)]
        assert "tool_data" not in info  # shown, not kept as data
        assert int(np.sum(obs == vision.placeholder_id)) == img.num_tokens
    finally:
        env.close()


def test_an_mcp_image_whose_bytes_are_not_an_image_is_kept_as_data_and_said():
    import base64
    from types import SimpleNamespace

    from tokengym.envs.mcp.tools import result_parts_of

    png = __import__("io").BytesIO()
    picture(4, 8, 8).save(png, format="PNG")
    good = SimpleNamespace(type="image", mime_type="image/png", data=base64.b64encode(png.getvalue()).decode())
    bad = SimpleNamespace(type="image", mime_type="image/png", data=base64.b64encode(b"not a png").decode())
    text, shown, kept = result_parts_of(SimpleNamespace(content=[SimpleNamespace(type="text", text="two:"), good, bad]))
    assert len(shown) == 1 and shown[0].size == (8, 8)
    assert text == "two:\n[image: image/png, 9 bytes, kept as data]" and kept[0]["data"] == bad.data
