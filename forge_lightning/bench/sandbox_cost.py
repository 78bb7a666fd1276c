"""``python -m forge_lightning.bench.sandbox_cost``: what ``sandbox: process`` costs a call, as one
JSON line: the pool's start-up (the isolation probe, once per process, then the first call, which
starts a worker), a trivial reward's call on a batch through the reward path (``call_reward``) in
the sandbox and in the trainer's thread, and a sticky episode's open, method call and score (the
environment path, tools/environments.py) in the sandbox and in process. Each figure is the median
of ``--calls`` calls, in microseconds (the mean beside it); the whole-step overhead is measured
from outside (notebooks/figures/sandbox/README.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def trivial(prompts: list[str], responses: list[str]) -> list[float]:
    """A reward that costs nothing itself: what is timed is the way to it."""
    return [float(len(response) % 2) for response in responses]


class Steps:
    """A trivial stateful environment: its step counts, its score is the count."""

    def __init__(self) -> None:
        self.count = 0

    def reset(self) -> None:
        self.count = 0

    def step(self) -> int:
        """Count a step."""
        self.count += 1
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls timed per figure")
    parser.add_argument("--batch", type=int, default=32, help="responses per reward call (smoke: 4 x 8)")
    parser.add_argument("--workers", type=int, default=2, help="the sandbox's workers")
    parser.add_argument(
        "--reward",
        default=None,
        help="the reward timed, by import path (a class is made with no arguments; e.g. "
        "forge_lightning.rewards.library.GSM8KAnswerReward, smoke.yaml's); default: one that costs nothing",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    # Not at import time; Steps and trivial by their import path, not as __main__'s (python -m),
    # which a worker cannot import.
    from forge_lightning.bench.sandbox_cost import Steps, trivial  # noqa: PLC0415
    from forge_lightning.rewards.library import call_reward  # noqa: PLC0415
    from forge_lightning.rollout.tools.environments import sandboxed_environment  # noqa: PLC0415
    from forge_lightning.sandbox.pool import Sandbox  # noqa: PLC0415

    args = parse_args(argv)
    timed = trivial if args.reward is None else _imported(args.reward)
    prompts, responses = ["p"] * args.batch, [f"Answer: {i}" for i in range(args.batch)]
    references = [str(i % 3) for i in range(args.batch)]

    def reward(sandbox: Any) -> Callable[[], Any]:
        kwargs = {"references": references}  # the reward takes what it names (none: trivial)
        return lambda: call_reward(timed, prompts, responses, kwargs, None, sandbox)  # as smoke.yaml

    started = time.perf_counter()
    sandbox = Sandbox(args.workers)
    sandbox.prepare({"reward": timed, "environment_factory": Steps})  # probes the machine
    probed = time.perf_counter()
    reward(sandbox)()  # starts the first worker, which imports the prepared functions' modules
    first = time.perf_counter()
    try:
        figures = {
            "reward_thread": _timed(reward(None), args.calls),
            "reward_process": _timed(reward(sandbox), args.calls),
            "episode_open_thread": _timed(lambda: Steps().reset(), args.calls),
            "episode_open_process": _timed(
                lambda: sandboxed_environment(sandbox, Steps, Steps, {}, 60.0), args.calls
            ),
        }
        local, (remote, _) = Steps(), sandboxed_environment(sandbox, Steps, Steps, {}, 60.0)
        figures |= {
            "episode_call_thread": _timed(local.step, args.calls),
            "episode_call_process": _timed(remote.step, args.calls),
            "episode_score_process": _timed(remote.get_reward, args.calls),
        }
    finally:
        sandbox.close()
    result = {
        "reward": args.reward or "trivial",
        "calls": args.calls,
        "batch": args.batch,
        "workers": args.workers,
        "probe_s": round(probed - started, 4),
        "first_call_s": round(first - probed, 4),
        **{f"{name}_us": median for name, (median, _) in figures.items()},
        **{f"{name}_mean_us": mean for name, (_, mean) in figures.items()},
    }
    print(json.dumps(result), file=sys.stdout, flush=True)
    return result


def _imported(path: str) -> Any:
    """The object at the import path ``path``; a class made with no arguments."""
    module, _, name = path.rpartition(".")
    found = getattr(importlib.import_module(module), name)
    return found() if isinstance(found, type) else found


def _timed(call: Callable[[], Any], calls: int) -> tuple[float, float]:
    """The median and mean microseconds of ``calls`` calls of ``call`` (after one not counted)."""
    call()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - start) / 1000)
    return round(statistics.median(times), 1), round(statistics.fmean(times), 1)


if __name__ == "__main__":
    main()
