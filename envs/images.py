"""Images in the token stream: a message's image parts become the tokens its model's processor makes.

A vision-language model reads an image as a run of placeholder tokens (Qwen2-VL: one
``<|image_pad|>`` per merged patch) whose embeddings its vision encoder replaces. The chat
template writes one placeholder per image; how many the model needs depends on the image's size
and the processor's settings. Getting that count wrong is the classic silent failure of VLM RL
loops (features and placeholders disagree; the wrong ``pixel_values`` slice goes with a turn), so
here the count comes from the processor itself, once, and travels with the image
(:class:`StreamImage`): where its run starts in the stream, how long it is, the features the
model gets. The observation stays token ids; the images of an observation are in its
``info["images"]``.

A family plugs in through :class:`VisionProcessor`: the one placeholder id its template writes
and the features of an image. :class:`Qwen2VLVision` is Qwen2-VL's and Qwen2.5-VL's (and that of
the Qwen3 templates that write the same placeholder).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "ImageFeatures",
    "ImageTokenMismatch",
    "Qwen2VLVision",
    "StreamImage",
    "VisionProcessor",
    "check_image_runs",
    "expand_images",
    "is_image_part",
    "load_image",
    "split_images",
]


class ImageTokenMismatch(ValueError):
    """The placeholder tokens of an image disagree with its processor's features."""


@dataclass(frozen=True, eq=False)
class ImageFeatures:
    """What the model gets for one image: its pixel values (patches x features), its patch grid
    ``(t, h, w)`` and how many placeholder tokens stand for it in the stream."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    num_tokens: int

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ImageFeatures):
            return NotImplemented
        return (
            self.grid_thw == other.grid_thw and self.num_tokens == other.num_tokens
            and np.array_equal(self.pixel_values, other.pixel_values)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class StreamImage:
    """One image in an episode's stream: its placeholder run is ``ids[offset : offset + num_tokens]``.

    ``turn`` is the turn whose observation holds it (-1: the prompt), ``index`` its place among
    the episode's images."""

    image: Any
    features: ImageFeatures
    offset: int
    turn: int
    index: int
    placeholder_id: int
    source: str = "prompt"
    """Where it came from: ``"prompt"`` (the reset's messages) or ``"observation"`` (a turn's
    new messages: a user turn, a tool result)."""

    @property
    def num_tokens(self) -> int:
        return self.features.num_tokens

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StreamImage):
            return NotImplemented
        return (
            (self.offset, self.turn, self.index, self.placeholder_id, self.source)
            == (other.offset, other.turn, other.index, other.placeholder_id, other.source)
            and self.features == other.features
        )

    __hash__ = None  # type: ignore[assignment]

    def shifted(self, by: int) -> StreamImage:
        """The same image with its run ``by`` tokens later (an observation's images in the stream)."""
        return StreamImage(self.image, self.features, self.offset + by, self.turn, self.index, self.placeholder_id, self.source)


@runtime_checkable
class VisionProcessor(Protocol):
    """A model family's image side: the placeholder its template writes, the features of an image."""

    placeholder_id: int
    """The one token id the chat template writes per image (Qwen2-VL: ``<|image_pad|>``)."""

    def features(self, image: Any) -> ImageFeatures:
        """The image's pixel values, grid and placeholder count, as the model's processor makes them."""
        ...


def load_image(value: Any) -> Any:
    """An image part's value as an RGB ``PIL.Image``: a PIL image, PNG/JPEG bytes, a file path,
    or an ``(H, W, 3)`` uint8 array. Anything else is a ValueError that says what was given."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value if value.mode == "RGB" else value.convert("RGB")
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            with Image.open(io.BytesIO(bytes(value))) as img:
                return img.convert("RGB")
        except Exception as err:
            raise ValueError(f"an image part holds {len(value)} bytes that are not an image PIL can read: {err}") from err
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not os.path.isfile(path):
            raise ValueError(f"an image part names {path!r}, which is not a file")
        with Image.open(path) as img:
            return img.convert("RGB")
    if isinstance(value, np.ndarray):
        if value.ndim != 3 or value.shape[2] != 3 or value.dtype != np.uint8:
            raise ValueError(f"an image array must be (H, W, 3) uint8, got {value.dtype} of shape {value.shape}")
        return Image.fromarray(value, "RGB")
    raise ValueError(
        f"an image part holds a {type(value).__name__}; give a PIL image, PNG/JPEG bytes, a file path or an (H, W, 3) uint8 array"
    )


def is_image_part(part: Any) -> bool:
    """A content part that is an image: ``{"type": "image", "image": ...}`` (or ``"image"`` alone)."""
    return isinstance(part, dict) and (part.get("type") == "image" or ("image" in part and "type" not in part))


def split_images(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The messages with each image part's value taken out (the part stays, as ``{"type": "image"}``,
    for the template to write its placeholder) and the images, in the order the parts come."""
    images: list[Any] = []
    out: list[dict[str, Any]] = []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list) or not any(is_image_part(p) for p in content):
            out.append(msg)
            continue
        parts = []
        for part in content:
            if is_image_part(part):
                if part.get("image") is None:
                    raise ValueError(f"a {msg.get('role')} message has an image part without its image (\"image\": ...)")
                images.append(part["image"])
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**msg, "content": parts})
    return out, images


def expand_images(
    ids: Sequence[int], features: Sequence[ImageFeatures], placeholder_id: int, *, turn: int, first_index: int = 0
) -> tuple[list[int], list[int]]:
    """``ids`` with the i-th placeholder repeated ``features[i].num_tokens`` times, and where each
    run starts. A template that wrote another number of placeholders than there are images (it
    dropped one, or wrote two) is an :class:`ImageTokenMismatch` naming the turn."""
    at = [k for k, i in enumerate(ids) if i == placeholder_id]
    if len(at) != len(features):
        where = "the prompt" if turn < 0 else f"turn {turn}'s observation"
        which = f"#{first_index}" if len(features) == 1 else f"#{first_index}..#{first_index + len(features) - 1}"
        raise ImageTokenMismatch(
            f"{where} has {len(features)} image(s) ({which}) but the chat "
            f"template wrote {len(at)} image placeholder token(s) (id {placeholder_id}): the template does not "
            "render these image parts one placeholder each (a text-only template, or images in a role it drops)"
        )
    out: list[int] = []
    offsets: list[int] = []
    last = 0
    for k, f in zip(at, features, strict=True):
        out.extend(ids[last:k])
        offsets.append(len(out))
        out.extend([placeholder_id] * f.num_tokens)
        last = k + 1
    out.extend(ids[last:])
    return out, offsets


def check_image_runs(ids: np.ndarray, images: Sequence[StreamImage], *, where: str) -> None:
    """Every image's run in ``ids`` holds exactly its ``num_tokens`` placeholders and no
    placeholder stands outside a run: else an :class:`ImageTokenMismatch` naming the image and its
    turn (what a trainer would otherwise find as a shape error, or never)."""
    if not images:
        return
    pid = images[0].placeholder_id
    covered = np.zeros(len(ids), dtype=bool)
    for img in images:
        end = img.offset + img.num_tokens
        run = ids[img.offset : end]
        turn = "the prompt" if img.turn < 0 else f"turn {img.turn}"
        if img.offset < 0 or end > len(ids) or not np.all(run == pid):
            raise ImageTokenMismatch(
                f"{where}: image #{img.index} ({turn}) should stand as {img.num_tokens} placeholder tokens at "
                f"{img.offset}..{end}, but the stream there holds {int(np.sum(run == pid))} of them"
            )
        if (img.offset > 0 and ids[img.offset - 1] == pid) or (end < len(ids) and ids[end] == pid):
            raise ImageTokenMismatch(
                f"{where}: image #{img.index} ({turn}) has more placeholder tokens around its run of {img.num_tokens}: "
                "its features and the stream disagree"
            )
        covered[img.offset : end] = True
    stray = np.flatnonzero((ids == pid) & ~covered)
    if stray.size:
        raise ImageTokenMismatch(
            f"{where}: {stray.size} image placeholder token(s) belong to no image (first at {int(stray[0])})"
        )


@dataclass
class Qwen2VLVision:
    """Qwen2-VL's image side (Qwen2.5-VL's too): transformers' own ``Qwen2VLImageProcessor``.

    An image of ``H x W`` pixels is resized to a multiple of ``patch_size * merge_size`` within
    ``[min_pixels, max_pixels]``, cut into patches, and stands as ``t * h * w / merge_size**2``
    ``<|image_pad|>`` tokens. The settings must be the model's (its preprocessor config): another
    ``merge_size`` gives another count, which the policy refuses by name.
    """

    tokenizer: Any
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    placeholder: str = "<|image_pad|>"
    placeholder_id: int = field(init=False)
    _processor: Any = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        from .tokenizers import load_tokenizer

        tok = load_tokenizer(self.tokenizer) if isinstance(self.tokenizer, str) else self.tokenizer
        self.tokenizer = tok
        pid = tok.convert_tokens_to_ids(self.placeholder)
        if not isinstance(pid, int) or pid == getattr(tok, "unk_token_id", None) or pid < 0:
            raise ValueError(f"the tokenizer has no {self.placeholder!r} token: it is not a Qwen2-VL-family tokenizer")
        self.placeholder_id = pid

    @property
    def processor(self) -> Any:
        if self._processor is None:
            try:
                from transformers import Qwen2VLImageProcessorPil as Processor  # no torchvision needed
            except ImportError:
                from transformers import Qwen2VLImageProcessor as Processor
            self._processor = Processor(
                min_pixels=self.min_pixels, max_pixels=self.max_pixels, patch_size=self.patch_size,
                merge_size=self.merge_size, temporal_patch_size=self.temporal_patch_size,
            )
        return self._processor

    def features(self, image: Any) -> ImageFeatures:
        out = self.processor(images=[load_image(image)], return_tensors="np")
        grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"])[0])
        t, h, w = grid
        return ImageFeatures(np.asarray(out["pixel_values"], dtype=np.float32), (t, h, w), t * h * w // self.merge_size**2)
