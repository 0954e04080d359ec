"""The token-id sequence space, with the shared memory gymnasium's ``AsyncVectorEnv`` asks for.

``AsyncVectorEnv`` passes observations through shared memory by default, and gymnasium
refuses that for ``Sequence`` spaces (their length varies), so
``gym.make_vec(id, vectorization_mode="async")`` failed unless the caller knew to pass
``vector_kwargs={"shared_memory": False}``. :class:`TokenSequence` is a ``Sequence`` (equal to
``Sequence(Discrete(vocab), stack=True)``; batching, sampling and checks are gymnasium's) for
which tokengym registers shared memory the way gymnasium's error message invites: a fixed
buffer of :attr:`TokenSequence.capacity` ids per env and the length of the current
observation.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import create_shared_memory, read_from_shared_memory, write_to_shared_memory

__all__ = ["DEFAULT_SHARED_CAPACITY", "TokenBatch", "TokenSequence"]

DEFAULT_SHARED_CAPACITY = 32768
"""Ids one observation may hold in an async vector env's shared memory (ChatEnv's default context)."""


class TokenSequence(spaces.Sequence):
    """``Sequence(Discrete(vocab_size), stack=True)`` whose observations an ``AsyncVectorEnv``
    can share: up to ``capacity`` ids each (256 KiB of shared memory per env by default)."""

    def __init__(self, vocab_size: int, capacity: int = DEFAULT_SHARED_CAPACITY, seed: Any = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        # stack=True, but the stacked feature space (with the two random generators gymnasium makes
        # for it, 2 kB of an env's memory) is built when a sample or a JSON form first asks for it
        super().__init__(spaces.Discrete(vocab_size), seed=seed, stack=False)
        self.stack = True
        self.capacity = int(capacity)

    @property  # type: ignore[override]
    def stacked_feature_space(self) -> spaces.Space[Any]:
        built = self.__dict__.get("_stacked")
        if built is None:
            from gymnasium.vector.utils import batch_space

            built = self.__dict__["_stacked"] = batch_space(self.feature_space, 1)
        return built


class TokenBatch(SequenceABC):
    """The observations of a vector env's envs, read live from shared memory.

    ``AsyncVectorEnv`` returns ``deepcopy`` of it (its default ``copy=True``): a tuple of
    int64 arrays, as with ``shared_memory=False``.
    """

    def __init__(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        self._ids, self._lengths = ids, lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        return self._ids[index][: int(self._lengths[index])]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def __deepcopy__(self, memo: dict[int, Any]) -> tuple[np.ndarray, ...]:
        return tuple(np.array(a, dtype=np.int64) for a in self)

    def __repr__(self) -> str:
        return f"TokenBatch({[len(a) for a in self]} ids)"


@create_shared_memory.register(TokenSequence)
def _create(space: TokenSequence, n: int = 1, ctx: Any = mp) -> tuple[Any, Any]:
    return ctx.Array("q", n * space.capacity, lock=False), ctx.Array("q", n, lock=False)


def _views(space: TokenSequence, memory: tuple[Any, Any]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.frombuffer(memory[0], dtype=np.int64).reshape(-1, space.capacity)
    return ids, np.frombuffer(memory[1], dtype=np.int64)


@read_from_shared_memory.register(TokenSequence)
def _read(space: TokenSequence, memory: tuple[Any, Any], n: int = 1) -> TokenBatch:
    ids, lengths = _views(space, memory)
    return TokenBatch(ids[:n], lengths[:n])


@write_to_shared_memory.register(TokenSequence)
def _write(space: TokenSequence, index: int, value: Any, memory: tuple[Any, Any]) -> None:
    arr = np.asarray(value, dtype=np.int64).reshape(-1)
    if len(arr) > space.capacity:
        raise ValueError(
            f"an observation of {len(arr)} tokens does not fit the {space.capacity} ids of an async vector env's "
            "shared memory; pass vector_kwargs={'shared_memory': False} to gym.make_vec "
            "(or shared_memory=False to AsyncVectorEnv)"
        )
    ids, lengths = _views(space, memory)
    ids[index, : len(arr)] = arr
    lengths[index] = len(arr)
