"""The groups of what rewards/, run/sandbox.py and evaluation/ read: how reward calls fail, where
rewards and tools run, and what a validation samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from forge_lightning.settings.declare import (
    POSITIVE,
    SECONDS,
    SHARE,
    Group,
    count,
    maybe_count,
    one_of,
    optional,
    setting,
)


@dataclass(frozen=True)
class RewardSettings(Group):
    """How reward calls fail."""

    on_reward_error: Literal["raise", "zero"] = setting("raise", check=one_of("raise", "zero"), resume=True)
    """``raise`` names the failing reward and sample; ``zero`` scores it 0 and counts it."""
    reward_timeout: float | None = setting(None, check=SECONDS, resume=True)
    """seconds a reward call may take; a longer one is abandoned and its batch fails as under
    ``on_reward_error``; None waits for ever (under ``sandbox: process``, 60 s)."""


@dataclass(frozen=True)
class SandboxSettings(Group):
    """Where rewards and tools run (run/sandbox.py)."""

    sandbox: Literal["thread", "process"] = setting("thread", check=one_of("thread", "process"), resume=True)
    """``thread``: in the trainer's process (a timeout abandons the call's thread, which runs on);
    ``process``: each call in a pool of sandboxed worker processes (no network and no sockets,
    reads only Python and the user's modules, writes only a scratch folder, none of the trainer's
    environment variables but ``sandbox_env``'s, as nobody under a root trainer, the limits
    below; what it returns crosses back as data, never unpickled), killed with everything it
    started past its call's time limit (60 s where None); refused at the start where
    the machine cannot isolate. A RewardModel stays in the trainer's process. An
    ``environment_factory``'s environment lives in one worker's process for its whole episode
    (its tools and its score are called there; episodes share the workers)."""
    sandbox_memory_mb: int = setting(
        2048, check=(lambda v: isinstance(v, int) and v >= 64, "an integer >= 64 (MiB)"), resume=True
    )
    """``process``: the address space a call may add to its worker's, in MiB."""
    sandbox_cpu_seconds: int = setting(60, check=count(1), resume=True)
    """``process``: the CPU seconds of one call."""
    sandbox_workers: int = setting(2, check=count(1), resume=True)
    """``process``: worker processes, so calls that may run at once (an episode's among them)."""
    sandbox_env: list[str] | None = setting(
        None,
        check=(
            optional(lambda v: isinstance(v, list | tuple) and all(isinstance(n, str) and n for n in v)),
            "None or a list of environment variables' names",
        ),
        resume=True,
    )
    """``process``: the names of the trainer's environment variables that cross into the workers
    (an API key a reward needs); no other variable does. A name that is not set does not cross."""


@dataclass(frozen=True)
class ValidationSettings(Group):
    """The sampled completions of a validation, besides the greedy one (evaluation/sampled.py)."""

    val_num_generations: int = setting(0, check=count(0), resume=True)
    """completions sampled per validation prompt (n) for val/mean@n, pass@k and maj@k; 0: greedy
    only. With n, each validation also logs k = 1, 2, 4, ..., n,
    ``frac_all_correct``/``frac_none_correct`` and the samples' length and truncated share, and
    the answers file holds the samples (evaluation/sampled.py). They are drawn under their own
    seeded RNG: a fit trains the same with or without them. Under DDP/FSDP each prompt counts once
    (evaluation/ranks.py)."""
    val_temperature: float = setting(1.0, check=POSITIVE, resume=True)
    """temperature of the sampled validation completions."""
    val_top_p: float = setting(1.0, check=SHARE, resume=True)
    """nucleus mass of the sampled validation completions."""
    val_max_new_tokens: int | None = setting(None, check=maybe_count(1), resume=True)
    """longest validation completion, greedy and sampled alike (and ``predict``'s); None:
    ``max_new_tokens``. A model trained on short completions can then be judged at a longer one."""

    def max_new_tokens(self, training: int) -> int:
        """The longest validation completion, given training's longest."""
        return self.val_max_new_tokens or training
