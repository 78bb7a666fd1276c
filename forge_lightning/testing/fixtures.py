"""The kit's pytest fixtures, a pytest plugin: enable them in a ``conftest.py`` with
``pytest_plugins = ["forge_lightning.testing.fixtures"]``.

- ``tiny_policy``: a fresh :class:`~forge_lightning.testing.TinyPolicy` (tokenizer and model).
- ``scripted_rollout``: :func:`~forge_lightning.testing.scripted_rollout` on that policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from forge_lightning import testing
from forge_lightning.testing import ScriptedRollout, TinyPolicy


@pytest.fixture
def tiny_policy() -> TinyPolicy:
    """A tiny tokenizer (bytes, ChatML) and a 2-layer random Llama, seeded, built for the test."""
    return testing.tiny_policy()


@pytest.fixture
def scripted_rollout(tiny_policy: TinyPolicy) -> Callable[..., ScriptedRollout]:
    """``scripted_rollout(prompts, completions, reward=..., tools=..., ...)`` on ``tiny_policy``."""
    return functools.partial(testing.scripted_rollout, policy=tiny_policy)
