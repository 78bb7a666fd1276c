"""The trainer's handle on a sticky episode of the sandbox (sandbox/pool.py's
:meth:`~forge_lightning.sandbox.pool.Sandbox.open_episode`): the worker whose process holds the
episode's environment, and the episode's id there. Its calls go to that worker alone; when the
handle is dropped (garbage-collected), the episode is queued for release, and its worker ends its
process with the next episode message it gets."""

from __future__ import annotations

import weakref
from typing import Any


class SandboxEpisode:
    """One episode in one sandbox worker.

    Args:
        sandbox: the Sandbox that opened it.
        worker: the worker that holds it.
        episode: its id in that worker.
        name: what its errors name (the environment's class).
    """

    def __init__(self, sandbox: Any, worker: Any, episode: int, name: str) -> None:
        self.sandbox, self.worker, self.id, self.name = sandbox, worker, episode, name
        worker.episodes.add(episode)
        weakref.finalize(self, _release, worker.episodes, worker.releases, episode)

    def call(self, method: str, kwargs: dict[str, Any], timeout: float | None, name: str) -> Any:
        """``method(**kwargs)`` on the episode's environment, in its worker (Sandbox.call_episode)."""
        return self.sandbox.call_episode(self, method, kwargs, timeout, name)

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError(
            f"an episode of {self.name} lives in a sandbox worker of this process: it cannot be "
            "copied or pickled"
        )


def _release(episodes: set[int], releases: list[int], episode: int) -> None:
    episodes.discard(episode)
    releases.append(episode)
