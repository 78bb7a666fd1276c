"""A test kit for users' rewards, tools and environments: a tiny policy built in the test
(tiny.py) and rollouts whose completions the test writes (scripted.py), through the package's
own tool loop and reward scoring, on CPU in well under a second. The pytest fixtures live in
fixtures.py: ``pytest_plugins = ["forge_lightning.testing.fixtures"]`` in a conftest.py."""

from forge_lightning.testing.engine import ScriptedEngine
from forge_lightning.testing.scripted import ScriptedRollout, ScriptedSample, Turns, scripted_rollout
from forge_lightning.testing.tiny import CHATML_TEMPLATE, TinyPolicy, tiny_model, tiny_policy, tiny_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "ScriptedEngine",
    "ScriptedRollout",
    "ScriptedSample",
    "TinyPolicy",
    "Turns",
    "scripted_rollout",
    "tiny_model",
    "tiny_policy",
    "tiny_tokenizer",
]
