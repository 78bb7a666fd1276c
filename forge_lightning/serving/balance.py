"""How a request's prompts are shared among the live rollout servers, and the seed each share is
sampled with: plain functions of numbers, so each rule is tested on lists written by hand."""

from __future__ import annotations

from collections.abc import Sequence

from forge_lightning.rollout.in_flight import rollout_seed


def prompt_cost(prompt_length: int, longest_completion: int, completions: int) -> int:
    """The tokens a server holds for one prompt at most: the prompt and each of its completions."""
    return (prompt_length + longest_completion) * completions


def balanced(costs: Sequence[int], outstanding: Sequence[int]) -> list[list[int]]:
    """The prompt indices each server samples: the costliest prompt first, each to the server with
    the fewest tokens outstanding (``outstanding``: what each already holds for this process), so
    that the servers finish together. Each list keeps the prompts' order; a server may get none."""
    load = list(outstanding)
    shares: list[list[int]] = [[] for _ in load]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        server = min(range(len(load)), key=lambda s: (load[s], s))
        shares[server].append(index)
        load[server] += costs[index]
    return [sorted(share) for share in shares]


def stream_seed(run_seed: int, rank: int) -> int:
    """The seed of one trainer rank's requests in a run seeded ``run_seed``: ranks sample apart."""
    return rollout_seed(run_seed, rank)


def share_seed(request_seed: int, share: int) -> int:
    """The seed of the ``share``-th part of a request seeded ``request_seed``; the only part of a
    request sent whole keeps the request's own seed, so one server samples as the trainer's own
    engine would."""
    return request_seed if share == 0 else rollout_seed(request_seed, share)
