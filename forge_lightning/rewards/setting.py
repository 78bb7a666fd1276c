"""What the module's ``reward`` setting says when it is given a string that names no reward.

A config or the command line may give ``reward`` any string (rewards.RewardArgument admits one, so
that jsonargparse does not answer with its parse of every Union subtype): an import path is the
function or class it names, and any other string is refused here, by what it looks like. A model
folder or hub id, TRL's ``reward_funcs="path/or/id"`` habit, points at
:class:`~forge_lightning.rewards.reward_model.RewardModel`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # "name" or "namespace/name"
CALLABLE_REWARD = (
    "reward must be a callable (prompts, responses, **kwargs) -> scores, a list of them, or the import "
    "path of one"
)


class RewardSettingError(TypeError, ValueError):
    """The reward setting names no reward. A TypeError (what a reward that is not callable always
    raised) and a ValueError, which the CLI reports in one line like any other bad setting."""


def refuse_strings(reward: Any) -> None:
    """Raise :class:`RewardSettingError` for ``reward``, or the first entry of a list of them,
    that is still a string: no import path made it a reward."""
    for entry in reward if isinstance(reward, (list, tuple)) else [reward]:
        if isinstance(entry, str):
            raise RewardSettingError(_why_not_a_reward(entry))


def _why_not_a_reward(value: str) -> str:
    exists = Path(value).expanduser().exists()
    if _IMPORT_PATH.fullmatch(value) and not exists:
        return (
            f"{CALLABLE_REWARD}: {value!r} does not import here (a typo, or a package that is not installed)"
        )
    if not exists and not _HUB_ID.fullmatch(value):
        return f"{CALLABLE_REWARD}; got the string {value!r}, which names no function, folder or hub id"
    what = (
        "a causal LM (a policy), not a reward model, which is a sequence classifier with one label"
        if is_causal_lm(Path(value))
        else "a model folder or hub id, not a reward"
    )
    return (
        f"reward {value!r} is {what}. A trained reward model is a reward as RewardModel({value!r}) "
        "(forge_lightning.rewards); in a config: `reward: {class_path: "
        f"forge_lightning.rewards.RewardModel, init_args: {{model: {value}}}}}`"
    )


def is_causal_lm(folder: Path) -> bool:
    """Whether ``folder`` holds a model whose config names a ``...ForCausalLM`` architecture."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return any(str(name).endswith("ForCausalLM") for name in architectures or [])
