"""Which calls ran at once, read from when each began and ended (``time.monotonic``), on a machine
however busy: a test that asserts calls overlap counts them, never times them against a bound."""

from __future__ import annotations

from collections.abc import Sequence


def running_at_each_start(spans: Sequence[tuple[float, ...]]) -> list[int]:
    """For each span ``(began, ended, ...)``, how many spans (itself among them) were running when it
    began: all 1 where the calls ran one after another."""
    return [sum(began <= start < ended for began, ended, *_ in spans) for start, *_ in spans]
