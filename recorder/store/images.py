"""A store's images: each held once, content-addressed, beside the shards.

A row holds its images' places in the stream and a key each; the image itself (as PNG) and
the features the model was given (pixel values, patch grid, placeholder count) are one file,
``images/<sha256>.npz``, named by the SHA-256 of that content, so an image shown to every
episode of a group is stored once. The file is written (fsynced, renamed into place) before
the row that names it is appended, so a row whose ``write`` returned never names a missing
file; a reader checks each file against its name and refuses one that does not match.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CorruptShardError
from .files import atomic_write

__all__ = ["IMAGES_DIR", "image_key", "load_image_entry", "save_image"]

IMAGES_DIR = "images"


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image_key(png: bytes, pixel_values: np.ndarray, grid_thw: tuple[int, ...], num_tokens: int) -> str:
    """The SHA-256 that names an image's file: of its PNG, its pixel values (float32, shape
    included), its grid and its placeholder count."""
    h = hashlib.sha256(b"tokengym-image-1")
    pv = np.ascontiguousarray(pixel_values, dtype="<f4")
    for part in (png, np.asarray(pv.shape, dtype="<i8").tobytes(), pv.tobytes(),
                 np.asarray(grid_thw, dtype="<i8").tobytes(), np.asarray([num_tokens], dtype="<i8").tobytes()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def save_image(root: Path, img: Any) -> dict[str, Any]:
    """Store ``img`` (a :class:`~tokengym.envs.images.StreamImage`) under ``root/images`` unless
    it is there already; its row entry (key and place in the stream)."""
    f = img.features
    png = _png(img.image)
    key = image_key(png, f.pixel_values, f.grid_thw, f.num_tokens)
    folder = root / IMAGES_DIR
    path = folder / f"{key}.npz"
    if not path.exists():
        folder.mkdir(exist_ok=True)
        atomic_write(path, lambda fh: np.savez(
            fh, png=np.frombuffer(png, dtype=np.uint8), pixel_values=np.asarray(f.pixel_values, dtype=np.float32),
            grid_thw=np.asarray(f.grid_thw, dtype=np.int64), num_tokens=np.asarray(f.num_tokens, dtype=np.int64),
        ))
    return {
        "sha256": key, "offset": int(img.offset), "num_tokens": int(f.num_tokens), "turn": int(img.turn),
        "index": int(img.index), "placeholder_id": int(img.placeholder_id), "source": str(img.source),
    }


def load_image_entry(root: Path, entry: dict[str, Any]) -> Any:
    """The :class:`~tokengym.envs.images.StreamImage` of a row's entry, its file checked against its name."""
    from PIL import Image

    from tokengym.envs.images import ImageFeatures, StreamImage

    key = str(entry["sha256"])
    path = root / IMAGES_DIR / f"{key}.npz"
    if not path.is_file():
        raise CorruptShardError(f"image {key} (#{entry['index']}) is missing: {IMAGES_DIR}/{key}.npz is not in the store")
    try:
        with np.load(path) as z:
            png, pv = z["png"].tobytes(), z["pixel_values"]
            grid, n = tuple(int(x) for x in z["grid_thw"]), int(z["num_tokens"])
    except Exception as err:
        raise CorruptShardError(f"{IMAGES_DIR}/{key}.npz cannot be read ({err})") from err
    if image_key(png, pv, grid, n) != key:
        raise CorruptShardError(f"{IMAGES_DIR}/{key}.npz does not hold what its name says (damaged, or replaced)")
    if n != entry["num_tokens"]:
        raise CorruptShardError(f"image #{entry['index']}: the row says {entry['num_tokens']} tokens, its file {n}")
    with Image.open(io.BytesIO(png)) as im:
        image = im.convert("RGB")
    return StreamImage(
        image, ImageFeatures(pv, (grid[0], grid[1], grid[2]), n), int(entry["offset"]), int(entry["turn"]),
        int(entry["index"]), int(entry["placeholder_id"]), str(entry["source"]),
    )
