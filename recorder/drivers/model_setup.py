"""Set up an env and a transformers policy from a model's name, as ``tokengym rollout --model``
and ``rollout(env, "smollm2")`` do.

A model's name decides more than its weights: the env must render with the model's
tokenizer, and the bundled SmolLM2's own chat template drops tool schemas, calls and
results, so an env with tools gets tokengym's ``CHATML_TOOLS`` for it. That choice changes
every prompt token, so it is said in one line (:func:`env_template`), never made silently.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tokengym.policies.models import ModelChoice, is_bundled_model, resolve_model

__all__ = ["env_has_tools", "env_template", "model_policy"]


def env_has_tools(make_env: Any) -> bool | None:
    """Whether the env a registered id (or an ``EnvRef``) names is a tool env, read from its
    class without making it; None when it cannot be told (a factory function, not a class)."""
    import gymnasium as gym
    from gymnasium.envs.registration import load_env_creator

    from tokengym.envs import ChatEnv, EnvRef, resolve_env_id
    from tokengym.envs.tool_env import ToolEnv

    if isinstance(make_env, EnvRef):
        env_id = resolve_env_id(make_env.spec, make_env.imports)
    elif isinstance(make_env, str):
        env_id = resolve_env_id(make_env)
    else:
        return None
    entry = gym.spec(env_id).entry_point
    creator = load_env_creator(entry) if isinstance(entry, str) else entry
    if isinstance(creator, type) and issubclass(creator, ChatEnv):
        return issubclass(creator, ToolEnv)
    return None


def env_template(
    make_env: Any, tokenizer: Any, env_kwargs: dict[str, Any], *, given: str = "env_kwargs"
) -> tuple[str | None, str | None]:
    """(the chat template to add to the env's kwargs, the line that says which template the env
    renders with and why) for an env whose tokenizer is named ``tokenizer``; (None, None) when
    that is not the bundled model's.

    ``given`` names where a ``chat_template`` already in ``env_kwargs`` came from (it is kept).
    """
    if not is_bundled_model(tokenizer):
        return None, None
    name = make_env.spec if hasattr(make_env, "spec") else make_env if isinstance(make_env, str) else "the env"
    if env_kwargs.get("chat_template") is not None:
        return None, f"chat template: the one passed in {given} (not SmolLM2's own, nor CHATML_TOOLS)"
    tools = env_has_tools(make_env)
    if tools is False:
        return None, f"chat template: SmolLM2's own ({name} is not a tool env)"
    why = (
        f"{name} has tools"
        if tools
        else f"cannot tell whether {name} has tools; CHATML_TOOLS renders chats without tools too"
    )
    return resolve_model(tokenizer).tool_template, (
        f"chat template: tokengym.envs.templates.CHATML_TOOLS ({why}, and SmolLM2's own drops tool schemas, "
        "calls and results)"
    )


def model_policy(
    model: Any, make_env: Any, env_kwargs: dict[str, Any] | None, *, local: bool
) -> tuple[Callable[[], Any], dict[str, Any], str | None]:
    """(a factory of the :class:`~tokengym.policies.HFPolicy` for the model named ``model``,
    the env kwargs with the model's tokenizer and template added, the template line).

    The tokenizer is added only for an env named by id (a factory makes its own env) without
    one; ``local``: load it once here and share it (the GGUF tokenizer takes seconds to read),
    else pass its name (each Ray worker loads its own).
    """
    from tokengym.envs.tokenizers import load_tokenizer
    from tokengym.policies import HFPolicy

    choice: ModelChoice = resolve_model(model)
    kwargs = dict(env_kwargs or {})
    tokenizer: Any = None
    if isinstance(make_env, str) and "tokenizer" not in kwargs:
        tokenizer = load_tokenizer(choice.name) if local else choice.name
        kwargs["tokenizer"] = tokenizer
    named = choice.name if tokenizer is not None else kwargs.get("tokenizer")
    template, note = env_template(make_env, named, kwargs) if isinstance(make_env, str) else (None, None)
    if template is not None:
        kwargs["chat_template"] = template
    if local and tokenizer is not None:
        return functools.partial(HFPolicy, choice.name, tokenizer), kwargs, note
    return functools.partial(HFPolicy, choice.name), kwargs, note
