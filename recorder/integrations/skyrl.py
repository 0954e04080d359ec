"""SkyRL: tokengym environments behind skyrl-gym's text-in / text-out ``BaseTextEnv``.

SkyRL's generator drives an environment with text: ``env.init(prompt)`` returns the
conversation to start from, then each ``env.step(action)`` takes the model's output as a
string and returns ``{"observations": [messages], "reward", "done", "metadata"}``; the
generator renders the observation messages with the chat template and tokenizes them
itself. tokengym environments are token-in / token-out, so the adapter has to choose how
text maps onto tokens, and it says so:

- **Actions.** A string is encoded with the env's tokenizer (special-token text such as
  ``<|im_end|>`` becomes the special token; an empty string stands for the end-of-turn
  token alone, which is what a model whose stop token was stripped from the text produced).
  A sequence of ints is taken as the action's token ids, as they are.
- **The retokenization caveat.** Encoding decoded text does not always give back the ids
  the model sampled: a string has many tokenizations and the model may have sampled a
  non-canonical one, and decoding can drop or merge characters. The trajectory tokengym
  records (and the ``action_ids`` in ``metadata``) then holds the *re-encoded* ids, so a
  trainer using them may train on tokens the policy never produced. For exact token
  trajectories pass the sampled ids (``env.step(ids)``), or roll out with
  :func:`tokengym.recorder.rollout`. Every trajectory says which it got:
  ``metadata["reencoded"]`` (True when any action arrived as text) and
  ``metadata["reencoded_turns"]``; ``tokengym inspect`` counts the re-encoded episodes of a store.
- **Observations.** ``observations`` are the messages the env appended (tool results, a
  user reply), for a generator that renders them itself; ``metadata["observation_ids"]``
  are the exact tokens tokengym appends (template glue, the messages and the next
  generation prompt, mask 0), for a generator that keeps tokens. Likewise ``init``
  returns the opening messages and ``metadata["prompt_ids"]`` / ``metadata["tools"]``: a
  generator that renders the messages itself does not show the env's tools unless it
  passes ``metadata["tools"]`` to the template.

Each step's ``metadata`` has ``action_ids``, ``observation_ids``, ``turn``, ``closed_by``,
``tool_results``, and on the last step ``stop_reason`` and ``trajectory`` (the recorded
:class:`~tokengym.recorder.Trajectory`); :meth:`get_metrics` reports the last episode.

Where the episode's task comes from: SkyRL builds an env per dataset row as
``make(env_class, env_config=..., extras=row)``. ``extras["seed"]`` / ``extras["options"]``
(or the same keys in ``extras["extra_info"]``) reset the tokengym env with that seed and
options, and ``init`` returns the env's own opening messages (its prompt argument is then
not used); without them the prompt messages are the conversation
(``reset(options={"messages": prompt})``).

skyrl-gym is imported only when the adapter is used (``pip install skyrl-gym==0.4.0``)::

    from tokengym.recorder.integrations.skyrl import register_skyrl_envs
    import skyrl_gym

    register_skyrl_envs(tokenizer="qwen2.5")            # every tokengym/... id, in skyrl_gym's registry
    env = skyrl_gym.make("tokengym/Calculator-v0", env_config={}, extras={"extra_info": {"seed": 3}})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["TokenGymTextEnv", "load_base", "register_skyrl_envs"]

INSTALL_HINT = "pip install skyrl-gym==0.4.0"
_CLASS: type | None = None


def load_base() -> type:
    """skyrl-gym's ``BaseTextEnv``, or an ImportError that says how to install it."""
    try:
        from skyrl_gym.envs.base_text_env import BaseTextEnv
    except ImportError as err:
        raise ImportError(f"tokengym.recorder.integrations.skyrl adapts tokengym envs to SkyRL and needs skyrl-gym: {INSTALL_HINT}") from err
    return BaseTextEnv


def _get(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` for a dict, an omegaconf DictConfig or None."""
    if config is None:
        return default
    try:
        return config.get(key, default)
    except AttributeError:
        return getattr(config, key, default)


def _plain(value: Any) -> Any:
    """An omegaconf container as plain Python (dicts and lists); anything else as it is."""
    to_container = getattr(type(value), "to_container", None)
    if to_container is not None and type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def _build_class() -> type:
    base = load_base()

    class TokenGymTextEnv(base):  # type: ignore[misc,valid-type]
        """A tokengym env as a SkyRL ``BaseTextEnv`` (see the module docstring for the text/token mapping).

        Args:
            env_config: SkyRL's per-env config; may give ``env_id``, ``tokenizer`` and ``env_kwargs``.
            extras: SkyRL's per-row extras; ``seed`` / ``options`` (or inside ``extra_info``) pick the task.
            env: a tokengym env instance to adapt (wins over ids).
            env_id: a registered tokengym id (what :func:`register_skyrl_envs` sets).
            **env_kwargs: ``gym.make`` arguments for ``env_id`` (``tokenizer`` among them).
        """

        def __init__(
            self,
            env_config: Any = None,
            extras: Mapping[str, Any] | None = None,
            *,
            env: Any = None,
            env_id: str | None = None,
            **env_kwargs: Any,
        ) -> None:
            super().__init__()
            import gymnasium as gym

            import tokengym.envs  # noqa: F401 -- registers the tokengym/... ids
            from ..wrapper import RecordEpisodes

            self.extras = dict(_plain(extras) or {})
            if env is None:
                env_id = env_id or _get(env_config, "env_id")
                if env_id is None:
                    raise ValueError("TokenGymTextEnv needs env=..., env_id=... or env_config['env_id']")
                kwargs = {**dict(_plain(_get(env_config, "env_kwargs")) or {}), **env_kwargs}
                if _get(env_config, "tokenizer") is not None:
                    kwargs.setdefault("tokenizer", _get(env_config, "tokenizer"))
                if "tokenizer" not in kwargs:
                    raise ValueError(f"{env_id} needs a tokenizer: env_config['tokenizer'] or tokenizer=...")
                env = gym.make(env_id, **kwargs)
            self.env = env if isinstance(env, RecordEpisodes) else RecordEpisodes(env, keep=False)
            self.max_turns = int(getattr(self.env.unwrapped, "max_turns", 1))
            self.trajectory = None
            self._started = False

        # ------------------------------------------------------------ helpers
        @property
        def renderer(self) -> Any:
            """The tokengym env's ChatRenderer (tokenizer and chat template)."""
            return self.env.unwrapped.renderer

        def _reset_spec(self, prompt: Any) -> tuple[int | None, dict[str, Any]]:
            info = dict(_plain(self.extras.get("extra_info")) or {})
            source = self.extras if ("seed" in self.extras or "options" in self.extras) else info
            if "seed" in source or "options" in source:
                seed = source.get("seed")
                return (None if seed is None else int(seed)), dict(_plain(source.get("options")) or {})
            messages = _plain(prompt)
            if messages:
                return None, {"messages": [dict(m) for m in messages]}
            return None, {}

        def encode_action(self, action: str | Sequence[int] | np.ndarray) -> np.ndarray:
            """The action's token ids: text encoded with the env's tokenizer, ids as given."""
            if isinstance(action, str):
                ids = self.renderer.encode(action) if action else list(self.renderer.turn_end_ids[-1:] or self.env.unwrapped.stop_token_ids[:1])
                return np.asarray(ids, dtype=np.int64)
            return np.asarray(action, dtype=np.int64)

        # --------------------------------------------------------- SkyRL API
        def init(self, prompt: Any = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            seed, options = self._reset_spec(prompt)
            obs, info = self.env.reset(seed=seed, options=options)
            self.turns = 0
            self.reencoded_turns = 0
            self.trajectory = None
            self._started = True
            metadata = {"prompt_ids": obs.tolist(), "tools": info.get("tools"), "task": info.get("task"), "seed": seed}
            return list(info.get("messages") or []), metadata

        def step(self, action: str | Sequence[int] | np.ndarray) -> dict[str, Any]:
            if not self._started:
                raise RuntimeError("call init(prompt) before step(action)")
            ids = self.encode_action(action)
            self.reencoded_turns += isinstance(action, str)  # text, not the sampled ids: see the caveat
            obs, reward, terminated, truncated, info = self.env.step(ids)
            self.turns += 1
            done = bool(terminated or truncated)
            from tokengym.envs.step_record import step_record

            record = step_record(info)
            if record.context_reset:
                raise ValueError(
                    "the env started a new context mid-episode (history='deploy'); SkyRL's text env keeps one "
                    "conversation per episode: use history='keep' with SkyRL"
                )
            metadata: dict[str, Any] = {
                "action_ids": ids.tolist(),
                "observation_ids": obs.tolist(),
                "turn": record.turn,
                "closed_by": record.closed_by,
                "tool_results": info.get("tool_results"),
            }
            if done:
                self.trajectory = info["trajectory"]
                # Said on the record itself (and counted by `tokengym inspect`): these actions are
                # the encoding of text, maybe not the ids the policy sampled.
                self.trajectory.metadata["reencoded"] = bool(self.reencoded_turns)
                self.trajectory.metadata["reencoded_turns"] = int(self.reencoded_turns)
                self._started = False
                metadata["stop_reason"] = record.stop_reason
                metadata["trajectory"] = self.trajectory
            observations = [] if done or not len(obs) else [dict(m) for m in info.get("messages") or []]
            return {
                "observations": observations,
                "reward": float(reward),
                "done": done,
                "metadata": metadata,
                "postprocessed_action": None,
            }

        def close(self) -> None:
            self.env.close()

        def get_metrics(self) -> dict[str, Any]:
            t = self.trajectory
            if t is None:
                return {"turns": self.turns}
            metrics: dict[str, Any] = {
                "turns": t.num_turns,
                "reencoded_turns": int(t.metadata.get("reencoded_turns", 0)),
                "reward": t.reward,
                "tokens": len(t),
                "policy_tokens": int(t.mask.sum()),
                "truncated": float(t.truncated),
            }
            for key, value in (t.metadata.get("tool_stats") or {}).items():
                metrics[f"tool_{key}"] = value
            return metrics

    TokenGymTextEnv.__module__ = __name__
    TokenGymTextEnv.__qualname__ = "TokenGymTextEnv"
    return TokenGymTextEnv


def __getattr__(name: str) -> Any:
    # The class derives from skyrl-gym's BaseTextEnv, so it is built on first use.
    global _CLASS
    if name == "TokenGymTextEnv":
        if _CLASS is None:
            _CLASS = _build_class()
        return _CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_skyrl_envs(env_ids: Sequence[str] | None = None, **env_kwargs: Any) -> list[str]:
    """Register tokengym envs in skyrl-gym's registry under their own ids; returns the ids.

    ``skyrl_gym.make(id, env_config=..., extras=...)`` then builds a :class:`TokenGymTextEnv`
    with ``gym.make(id, **env_kwargs)`` (``env_config["env_kwargs"]`` / ``["tokenizer"]`` add to them).
    Pass the tokenizer as a name or path: skyrl-gym deep-copies registered arguments on every make.
    """
    load_base()
    import skyrl_gym

    from tokengym.envs import registered_envs

    ids = list(env_ids) if env_ids is not None else registered_envs()
    for env_id in ids:
        if env_id in skyrl_gym.registry:
            skyrl_gym.envs.registration.deregister(env_id)
        skyrl_gym.register(id=env_id, entry_point=f"{__name__}:TokenGymTextEnv", kwargs={"env_id": env_id, **env_kwargs})
    return ids
