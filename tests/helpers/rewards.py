"""Reward functions of the tiny runs: what a random tiny model can learn, and scores that vary."""

from __future__ import annotations


def count_a(prompts: list[str], responses: list[str]) -> list[float]:
    """Fraction of 8 completion characters that are 'a': a task a random tiny model can learn."""
    return [sum(ch == "a" for ch in r) / 8 for r in responses]


def varied(prompts: list[str], responses: list[str]) -> list[float]:
    """0 to 4 by the completion's characters: scores that differ within most groups."""
    return [float(sum(map(ord, r)) % 5) for r in responses]
