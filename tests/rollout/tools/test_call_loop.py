"""Concurrent tool calls: the calls of every row that waits, and every call of one turn, run at
once up to ``max_parallel_tool_calls``, each under ``tool_timeout``; ``async def`` tools, methods
and resets are awaited; the answers keep the order the calls were written."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from helpers.engines import TurnEngine
from helpers.spans import running_at_each_start
from helpers.tools import GREEDY, call, chat_tokenizer, sampler, tiny

from forge_lightning.module import GRPOLightningModule
from forge_lightning.rollout.tools import CALL_FORMATS
from forge_lightning.rollout.tools.call_loop import CallLoop
from forge_lightning.rollout.tools.function_call import Job, Outcome
from forge_lightning.run.user_code import warn_thread_abandoned

NAPS: list[tuple[float, float, float]] = []
"""When each nap began and ended (time.monotonic), and how long it was asked to sleep: which calls ran
at once, on a machine however busy (where a short nap may take as long as a long one)."""


def nap(seconds: float, tag: str) -> str:
    """Sleeps, then answers its tag.

    Args:
        seconds: how long.
        tag: the answer.
    """
    began = time.monotonic()
    time.sleep(seconds)
    NAPS.append((began, time.monotonic(), seconds))
    return tag


async def async_nap(seconds: float, tag: str) -> str:
    """Sleeps without blocking the loop, then answers its tag.

    Args:
        seconds: how long.
        tag: the answer.
    """
    began = time.monotonic()
    await asyncio.sleep(seconds)
    NAPS.append((began, time.monotonic(), seconds))
    return tag


def two_naps(name: str, first: float, second: float) -> str:
    """A turn of two calls (Llama's JSON, which ends with the turn: both are the turn's), the first
    the slower: in the order written, it finishes last."""
    fmt = CALL_FORMATS["llama3_json"]()
    naps = ((first, "first"), (second, "second"))
    return "; ".join(fmt.write(name, {"seconds": seconds, "tag": tag}) for seconds, tag in naps)


@pytest.mark.parametrize("tool", [nap, async_nap])
def test_calls_of_all_rows_and_of_one_turn_take_the_longest_not_the_sum(tool):
    tok = chat_tokenizer()
    engine = TurnEngine(tok, [two_naps(tool.__name__, 0.3, 0.05), "done."])
    run = sampler(tok, [tool], engine, max_parallel=8, call_format="llama3_json")
    NAPS.clear()
    rollout = run(tiny(tok), ["Q", "R"], GREEDY, 2)  # 4 rows x 2 calls: 1.4 s one after another
    assert len(NAPS) == 8 and sorted(asked for _, _, asked in NAPS) == [0.05] * 4 + [0.3] * 4
    # how many calls ran at each call's start: one after another, never more than one; at once, all
    # eight, or (where a busy machine starts their threads late) at least half of them at some point
    at_once = running_at_each_start(NAPS)
    assert max(at_once) >= 4, f"the calls ran one after another: {at_once}"
    for log in rollout.facts()["tool_calls"]:
        assert [entry["result"] for entry in log] == ["first", "second"]  # the order written
    assert rollout.tool_stats["tool_calls"].tolist() == [2] * 4
    assert all(text.endswith("done.") for text in rollout.completions)


class Notebook:
    """An environment whose tool writes its tag down after a nap."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, seconds: float, tag: str) -> str:
        """Writes a tag down.

        Args:
            seconds: how long it takes.
            tag: what to write.
        """
        time.sleep(seconds)
        self.notes.append(tag)
        return tag


def test_calls_on_one_environment_take_effect_in_the_order_written():
    tok = chat_tokenizer()
    engine = TurnEngine(tok, [two_naps("note", 0.25, 0.0), "done."])
    run = sampler(tok, None, engine, env=Notebook, call_format="llama3_json")
    rollout = run(tiny(tok), ["Q", "R"], GREEDY, 2)
    assert [env.notes for env in rollout.facts()["environments"]] == [["first", "second"]] * 4


def test_at_most_max_parallel_calls_run_at_once():
    jobs = [Job(nap, {"seconds": 0.2, "tag": str(k)}, "nap") for k in range(6)]
    NAPS.clear()
    outcomes = CallLoop(max_parallel=2, timeout=5.0).run(jobs)
    assert [outcome.text for outcome in outcomes] == ["0", "1", "2", "3", "4", "5"]
    # how many naps ran at each nap's start: never more than two, and two at some point
    at_once = running_at_each_start(NAPS)
    assert len(NAPS) == 6 and max(at_once) == 2, at_once


@pytest.mark.integration  # waits out real time limits (about a second)
def test_each_call_has_its_own_time_limit_from_when_it_starts():
    jobs = [Job(nap, {"seconds": 0.15, "tag": str(k)}, "nap") for k in range(3)]
    jobs.insert(1, Job(nap, {"seconds": 3.0, "tag": "never"}, "nap"))
    start = time.monotonic()
    outcomes = CallLoop(max_parallel=1, timeout=0.3).run(jobs)
    # One at a time: the last waited ~0.75 s for its turn, past the limit, and still ran. The
    # abandoned call's thread sleeps on (in this process: no sandbox).
    late = Outcome("error: nap took longer than 0.3s", False, False, abandoned=True)
    assert outcomes == [("0", True, False, False), late, ("1", True, False, False), ("2", True, False, False)]
    assert time.monotonic() - start < 1.5


async def blocks(seconds: float) -> str:
    """Blocks its event loop: a sync sleep inside a coroutine.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "late"


@pytest.mark.integration  # waits out real time limits (about a second)
def test_an_async_tool_that_blocks_its_loop_times_out_without_holding_the_other_calls():
    finished: list[float] = []

    async def quick(tag: str) -> str:
        await asyncio.sleep(0.1)
        finished.append(time.monotonic())
        return tag

    jobs = [Job(blocks, {"seconds": 5.0}, "blocks"), Job(quick, {"tag": "row 2"}, "quick")]
    start = time.monotonic()
    outcomes = CallLoop(timeout=1.0).run(jobs)
    elapsed = time.monotonic() - start
    assert outcomes == [Outcome("error: blocks took longer than 1s", False, False, abandoned=True),
                        Outcome("row 2", True, False)]  # fmt: skip
    assert elapsed < 2.5, f"{elapsed:.2f}s: the blocked loop was waited for (5 s)"
    assert finished[0] - start < 1.0, "the other row's call waited behind the blocked loop"


@pytest.mark.integration  # waits out real time limits (about a second)
def test_an_abandoned_call_in_this_process_is_counted_and_warned_about_once(caplog):
    tok = chat_tokenizer()
    engine = TurnEngine(tok, [call("blocks", seconds=5.0), "done."])
    run = sampler(tok, [blocks], engine, timeout=1.0)
    warn_thread_abandoned.cache_clear()  # once per process: from this test's first call on
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="forge_lightning.run.user_code"):
        rollout = run(tiny(tok), ["Q"], GREEDY, 2)  # two rows, each blocked 5 s
    assert time.monotonic() - start < 2.5  # the rows' calls timed out side by side
    assert rollout.tool_stats["tool_threads_abandoned"].tolist() == [1, 1]
    assert rollout.tool_stats["tool_errors"].tolist() == [1, 1]
    entry = rollout.facts()["tool_calls"][0][0]
    assert entry["result"] == "error: blocks took longer than 1s" and entry["abandoned"] is True
    warned = [r.getMessage() for r in caplog.records if "keeps running" in r.getMessage()]
    assert len(warned) == 1 and "sandbox: process" in warned[0] and "tool_threads_abandoned" in warned[0]


async def refuses(x: int) -> int:
    """An async tool that fails.

    Args:
        x: anything.
    """
    raise SystemExit(2)


def test_an_async_tools_failure_is_its_calls_error():
    (outcome,) = CallLoop(timeout=1.0).run([Job(refuses, {"x": 1}, "refuses")])
    assert outcome[0].startswith("error: refuses raised SystemExit(2) from its own code") and not outcome[1]


class AsyncCounter:
    """An environment whose reset and tool are async."""

    def __init__(self) -> None:
        self.count, self.target = 0, None

    async def reset(self, reference: str) -> str:
        await asyncio.sleep(0)
        self.target = int(reference)
        return f"Reach {reference}."

    async def increment(self, by: int) -> int:
        """Add to the counter, slowly.

        Args:
            by: how much.
        """
        await asyncio.sleep(0.3)
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.target)


def test_an_environments_async_reset_and_methods_are_awaited_concurrently():
    tok = chat_tokenizer()
    engine = TurnEngine(tok, [call("increment", by=2), "done."])
    run = sampler(tok, None, engine, env=AsyncCounter)
    start = time.monotonic()
    rollout = run(tiny(tok), ["Q", "R"], GREEDY, 2, rows={"references": ["2", "3"]})
    assert time.monotonic() - start < 1.0  # four calls of 0.3 s
    assert "Reach 2." in engine.inputs[0]
    assert [e.count for e in rollout.facts()["environments"]] == [2, 2, 2, 2]
    assert [log[0]["result"] for log in rollout.facts()["tool_calls"]] == ["2"] * 4


def test_max_parallel_tool_calls_is_a_module_setting_the_tools_get():
    tok = chat_tokenizer()
    grpo = GRPOLightningModule(
        model=tiny(tok), tokenizer=tok, tools=[nap], use_chat_template=True, max_parallel_tool_calls=3
    )
    grpo.configure_model()
    assert grpo.episodes.tools.calls.max_parallel == 3
    with pytest.raises(ValueError, match="max_parallel_tool_calls must be an integer >= 1"):
        GRPOLightningModule(model=tiny(tok), tokenizer=tok, tools=[nap], max_parallel_tool_calls=0)
