"""Count the dots: a picture in the prompt, a ``zoom`` tool that returns a region of it as an image.

The smallest task in which a vision-language policy has to look, and to look again through a
tool: each episode draws 1 to ``max_dots`` coloured dots (some small) on a white picture, from
the reset's seed (no data set to download), and asks how many there are. ``zoom(x, y, width,
height)`` returns that region, enlarged, as an image in the tool message. Reward 1 for
``<answer>N</answer>`` with the right N.

It needs a vision-language setup: a tokenizer whose chat template renders image parts
(Qwen2-VL's, Qwen2.5-VL's, Qwen3.5's: ``corpus_tokenizer("Qwen3.5-4B")`` in
:mod:`tokengym.envs.template_corpus`) and the model's image settings (``vision=``; by default
:class:`~tokengym.envs.images.Qwen2VLVision` with small pictures: at most 16 placeholder tokens
an image).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..images import Qwen2VLVision
from ..tool_env import ToolEnv, answer_reward

__all__ = ["DotCountEnv", "draw_dots"]

PROMPT = (
    "How many dots are in this picture? The picture is {size}x{size} pixels; zoom(x, y, width, height) "
    "shows a region of it enlarged. Answer with <answer>N</answer>."
)
COLOURS = ((220, 40, 40), (40, 120, 220), (30, 160, 60), (200, 140, 20), (140, 60, 180))


def draw_dots(seed: int, *, size: int = 112, max_dots: int = 6) -> tuple[Any, list[tuple[int, int, int]]]:
    """The picture of ``seed`` (an RGB PIL image, ``size`` x ``size``) and its dots ``(x, y, radius)``:
    1 to ``max_dots`` of them, apart from each other."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([int(seed), size, max_dots])
    count = int(rng.integers(1, max_dots + 1))
    dots: list[tuple[int, int, int]] = []
    while len(dots) < count:
        r = int(rng.integers(2, max(3, size // 14)))
        x, y = (int(v) for v in rng.integers(r + 1, size - r - 1, size=2))
        if all((x - a) ** 2 + (y - b) ** 2 > (r + c + 3) ** 2 for a, b, c in dots):
            dots.append((x, y, r))
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    for k, (x, y, r) in enumerate(dots):
        draw.ellipse((x - r, y - r, x + r, y + r), fill=COLOURS[int(rng.integers(len(COLOURS))) if k else 0])
    return img, dots


class DotCountEnv(ToolEnv):
    """Count the dots of a picture, with a ``zoom`` tool that returns a region as an image.

    Args:
        tokenizer: a tokenizer whose chat template renders image parts (see the module's doc).
        vision: the model's image side; default :class:`~tokengym.envs.images.Qwen2VLVision` of
            ``tokenizer`` with at most ``size * size`` pixels an image.
        size: the picture's side in pixels.
        max_dots: at most this many dots (at least 1).
        **kwargs: as for :class:`~tokengym.envs.ToolEnv` (``max_turns`` defaults to 4).
    """

    step_waits = False  # drawing and cropping in this process
    needs_vision = True
    """Its prompt is a picture: it is built with a tokenizer whose chat template renders image parts."""
    reset_options = frozenset({"task", "picture_seed"})

    def __init__(self, tokenizer: Any, *, vision: Any = None, size: int = 112, max_dots: int = 6, **kwargs: Any) -> None:
        if size < 56 or max_dots < 1:
            raise ValueError(f"size must be >= 56 pixels and max_dots >= 1, got {size} and {max_dots}")
        kwargs.setdefault("max_turns", 4)
        kwargs.setdefault("reward_fn", answer_reward)
        super().__init__(tokenizer, tool_factory=self._zoom_tool, vision=vision, **kwargs)
        if self.vision is None:
            if self.history == "deploy":
                raise ValueError("history='deploy' does not take images yet: DotCountEnv needs history='keep'")
            self.vision = Qwen2VLVision(self.tokenizer, min_pixels=56 * 56, max_pixels=size * size)
            self._probe_images()
        self.size, self.max_dots = size, max_dots

    def sample_task(self, options: dict[str, Any]) -> dict[str, Any]:
        if "task" in options:
            return super().sample_task(options)
        seed = int(options["picture_seed"]) if "picture_seed" in options else int(self.np_random.integers(2**31))
        _, dots = self._picture(seed)
        return {"id": f"dots-{self.size}-{self.max_dots}-{seed}", "seed": seed, "answer": len(dots)}

    def _picture(self, seed: int) -> tuple[Any, list[tuple[int, int, int]]]:
        """:func:`draw_dots` of ``seed``, drawn once for the reset that asks for it three times
        (the task's answer, the prompt, the zoom tool)."""
        drawn = getattr(self, "_drawn", None)
        if drawn is None or drawn[0] != seed:
            drawn = self._drawn = (seed, draw_dots(seed, size=self.size, max_dots=self.max_dots))
        return drawn[1]

    def task_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        picture, _ = self._picture(int(task["seed"]))
        return [{"role": "user", "content": [
            {"type": "image", "image": picture},
            {"type": "text", "text": PROMPT.format(size=self.size)},
        ]}]

    def _zoom_tool(self, task: dict[str, Any]) -> list[Any]:
        picture, _ = self._picture(int(task["seed"]))
        side = self.size

        def zoom(x: int, y: int, width: int, height: int) -> Any:
            """Show a region of the picture, enlarged.

            Args:
                x: left edge of the region, in pixels from the left
                y: top edge of the region, in pixels from the top
                width: width of the region in pixels (at least 8)
                height: height of the region in pixels (at least 8)
            """
            if min(width, height) < 8 or x < 0 or y < 0 or x + width > side or y + height > side:
                return f"Error: the region must lie inside the {side}x{side} picture and be at least 8x8 pixels."
            region = picture.crop((x, y, x + width, y + height))
            scale = max(1, 56 // min(width, height) + 1)
            return [f"Region x={x}..{x + width}, y={y}..{y + height}:", region.resize((width * scale, height * scale))]

        return [zoom]
