"""Which completions of a rollout go through one forward/backward together: its micro-batches.

By count (the module's micro-batch size): consecutive rows. By a token budget (its micro-batch
tokens): the completions, longest first, packed in that order into
micro-batches under the budget, then balanced (the smallest budget that packs them into as many),
so that rows of like lengths share a micro-batch and pad each other little. Either way a micro-batch runs
only the columns its own rows need: the prompts' left padding common to all of its rows and the
completion columns after its longest completion are left out. Causal attention keeps both out of
every position the loss scores, so the log-probs are those of the whole rollout's forward.

Where the prompt can be shared (prefix sharing), micro-batches by count that hold whole groups
run each group's prompt once, and so does one that holds part of a single group (a micro-batch
smaller than the group: a group of 16 in micro-batches of 8 runs its prompt twice, not 16 times);
one across the border of two groups runs each row's own. A token budget packs whole groups, each prompt
running once for its G completions (a group over the budget by itself split into its rows), or
single rows, each with its prompt, or cuts each group, longest first, into runs of like lengths
that each run the group's prompt once (a micro-batch each: a group of 16 with a prompt of 150
tokens, two completions cut at 64 and fourteen of 20-30 runs as the two and the fourteen),
whichever runs fewer tokens in all: sharing saves the prompts' tokens, single rows and runs the
padding of a group's short completions to its longest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from forge_lightning.rollout.types import Rollout


@dataclass(frozen=True)
class MicroBatch:
    """Completion rows of a rollout that run through one forward together."""

    rows: Tensor  # (n,) long, ascending: the rollout's completion rows
    share: int  # consecutive rows that run their one prompt once (prefix sharing); 1: each its own
    prompt_width: int  # prompt columns it runs: its longest prompt
    completion_width: int  # completion columns it runs: through its longest completion

    @property
    def shared(self) -> bool:
        """Its rows share prompts: whole groups, or the part of one group it holds."""
        return self.share > 1

    @property
    def tokens(self) -> int:
        """Tokens (padding included) its forward runs: a prompt per run of ``share`` rows, and
        each row's completion columns."""
        rows = len(self.rows)
        return rows // self.share * self.prompt_width + rows * self.completion_width


@dataclass(frozen=True)
class _Lengths:
    """A rollout's lengths, per prompt (P,) and per completion row (P*G,)."""

    prompt: list[int]  # real prompt tokens
    completion: list[int]  # completion columns through the last one its mask covers
    group: int

    @classmethod
    def of(cls, rollout: Rollout) -> _Lengths:
        mask = rollout.completion_mask.bool()  # (P*G, Lc)
        columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
        ends = (mask * columns).amax(dim=1) if mask.shape[1] else mask.sum(dim=1)  # (P*G,)
        return cls(rollout.prompt_mask.sum(dim=1).tolist(), ends.tolist(), rollout.group_size)


@dataclass(frozen=True)
class _Unit:
    """Rows that stay together: one group (prefix sharing) or one completion."""

    rows: tuple[int, ...]
    shared: bool
    prompt: int  # its longest prompt
    completion: int  # its longest completion


@dataclass(frozen=True)
class _Bin:
    """What a micro-batch's tokens depend on."""

    units: int
    rows: int
    prompt: int
    completion: int
    shared: bool

    @classmethod
    def of(cls, unit: _Unit) -> _Bin:
        return cls(1, len(unit.rows), unit.prompt, unit.completion, unit.shared)

    def plus(self, other: _Bin) -> _Bin:
        return _Bin(
            self.units + other.units,
            self.rows + other.rows,
            max(self.prompt, other.prompt),
            max(self.completion, other.completion),
            self.shared and other.shared,
        )

    @property
    def tokens(self) -> int:
        """Tokens (padding included) of its forward: each shared group's prompt once and its rows'
        completions; else each row's prompt and completion; all padded to the longest."""
        if self.shared:
            return self.units * self.prompt + self.rows * self.completion
        return self.rows * (self.prompt + self.completion)


def _batch(units: list[_Unit], rollout: Rollout) -> MicroBatch:
    rows = torch.tensor(sorted(r for u in units for r in u.rows), dtype=torch.long)
    completion = min(max(max(u.completion for u in units), 1), rollout.completion_ids.shape[1])
    prompt = min(max(max(u.prompt for u in units), 1), rollout.prompt_ids.shape[1])
    sizes = {len(u.rows) for u in units}
    share = sizes.pop() if all(u.shared for u in units) and len(sizes) == 1 else 1
    return MicroBatch(rows.to(rollout.completion_ids.device), share, prompt, completion)


def _count_units(a: int, b: int, lengths: _Lengths, shared: bool) -> list[_Unit]:
    """Rows ``a..b-1`` of a micro-batch by count: whole groups that share their prompts, or, in a
    micro-batch smaller than a group and within one, its rows sharing their one prompt (a group of
    16 in micro-batches of 8 runs its prompt twice, not 16 times); else rows, each with its prompt."""
    group = lengths.group
    if shared and a % group == 0 and b % group == 0:
        spans = [range(g, g + group) for g in range(a, b, group)]
    elif shared and b - a > 1 and a // group == (b - 1) // group:
        spans = [range(a, b)]
    else:
        return [_row_unit(r, lengths, False) for r in range(a, b)]
    return [_shared_unit(tuple(rows), lengths) for rows in spans]


def _shared_unit(rows: tuple[int, ...], lengths: _Lengths) -> _Unit:
    """Rows of one group that run their prompt once."""
    prompt = lengths.prompt[rows[0] // lengths.group]
    return _Unit(rows, True, prompt, max(lengths.completion[r] for r in rows))


def plan_micro_batches(
    rollout: Rollout, *, size: int | None = None, tokens: int | None = None, shared: bool = False
) -> list[MicroBatch]:
    """The micro-batches of ``rollout``: of ``size`` consecutive rows (all rows when None), or, with
    ``tokens``, packed longest first into micro-batches of at most ``tokens`` tokens (padding
    included, see module doc) and at most ``size`` rows each. ``shared``: the model and scorer can
    share each group's prompt, so a micro-batch of whole groups runs it once per group."""
    lengths = _Lengths.of(rollout)
    group, count = rollout.group_size, len(lengths.completion)
    shared = shared and group > 1
    if tokens is None:
        step = size or max(count, 1)
        return [
            _batch(_count_units(a, b, lengths, shared), rollout)
            for a, b in ((a, min(a + step, count)) for a in range(0, count, step))
        ]
    # Whole groups share their prompt but pad their completions to the group's longest; single
    # rows pack by length: whichever runs fewer tokens in all.
    plans = [_packed(_units(lengths, tokens, s), tokens, size) for s in dict.fromkeys([shared, False])]
    if shared:  # each group's runs of like lengths, a micro-batch each
        plans.append([[run] for run in _group_runs(lengths, tokens, size)])
    best = min(plans, key=lambda bins: sum(_merged(b).tokens for b in bins))  # the first on a tie
    return [_batch(b, rollout) for b in best]


def _group_runs(lengths: _Lengths, tokens: int, size: int | None) -> list[_Unit]:
    """Each group's rows, longest first, cut into runs that each run the group's prompt once, at
    the cuts that run the fewest tokens in all (a run: the prompt, and its rows padded to its
    longest); no run of several rows over ``tokens`` tokens or ``size`` rows."""
    group, runs = lengths.group, []
    for p, prompt in enumerate(lengths.prompt):
        rows = sorted(range(p * group, (p + 1) * group), key=lambda r: -lengths.completion[r])
        # fewest[j]: the fewest tokens that run rows[:j]; start[j]: where its last run starts
        fewest, start = [0] + [-1] * group, [0] * (group + 1)
        for j in range(1, group + 1):
            for i in range(j):  # the run rows[i:j], padded to rows[i]'s length
                run = _Bin(1, j - i, prompt, lengths.completion[rows[i]], True).tokens
                if j - i > 1 and (run > tokens or (size is not None and j - i > size)):
                    continue
                if fewest[j] < 0 or fewest[i] + run < fewest[j]:
                    fewest[j], start[j] = fewest[i] + run, i
        cuts, j = [], group
        while j:
            cuts.append(tuple(sorted(rows[start[j] : j])))
            j = start[j]
        runs += [_shared_unit(run, lengths) for run in reversed(cuts)]
    return runs


def _packed(units: list[_Unit], tokens: int, size: int | None) -> list[list[_Unit]]:
    """``units``, longest first, packed under ``tokens`` tokens and ``size`` rows, balanced: the
    smallest budget under which the same packing still gives as many micro-batches."""
    units = sorted(units, key=lambda u: _Bin.of(u).tokens, reverse=True)  # a stable sort
    count = len(_greedy(units, tokens, size))
    low, high = 1, tokens
    while low < high:
        middle = (low + high) // 2
        if len(_greedy(units, middle, size)) <= count:
            high = middle
        else:
            low = middle + 1
    return _greedy(units, low, size)


def _merged(units: list[_Unit]) -> _Bin:
    merged = _Bin.of(units[0])
    for unit in units[1:]:
        merged = merged.plus(_Bin.of(unit))
    return merged


def _row_unit(row: int, lengths: _Lengths, shared: bool) -> _Unit:
    return _Unit((row,), shared, lengths.prompt[row // lengths.group], lengths.completion[row])


def _units(lengths: _Lengths, tokens: int, shared: bool) -> list[_Unit]:
    """Whole groups where prompts are shared (rows of a group over ``tokens``), rows otherwise."""
    group = lengths.group
    if not shared:
        return [_row_unit(r, lengths, False) for r in range(len(lengths.completion))]
    units: list[_Unit] = []
    for p in range(len(lengths.prompt)):
        whole = _shared_unit(tuple(range(p * group, (p + 1) * group)), lengths)
        fits = _Bin.of(whole).tokens <= tokens
        units += [whole] if fits else [_row_unit(r, lengths, False) for r in whole.rows]
    return units


def _greedy(units: list[_Unit], tokens: int, size: int | None) -> list[list[_Unit]]:
    """``units`` in order, a new micro-batch whenever the next would take the current one over
    ``tokens`` tokens or ``size`` rows (a unit over them alone is a micro-batch of its own)."""
    bins: list[list[_Unit]] = []
    current: _Bin | None = None
    for unit in units:
        one = _Bin.of(unit)
        grown = None if current is None else current.plus(one)
        if grown is not None and grown.tokens <= tokens and (size is None or grown.rows <= size):
            bins[-1].append(unit)
            current = grown
        else:
            bins.append([unit])
            current = one
    return bins


def padding_fraction(batches: list[MicroBatch], rollout: Rollout) -> float:
    """The share of the micro-batches' forward tokens that are padding: one minus the real prompt
    and completion tokens (a shared prompt once per group) over the tokens the forwards run."""
    lengths = _Lengths.of(rollout)
    group = rollout.group_size
    real = total = 0
    for batch in batches:
        rows = batch.rows.tolist()
        prompts = [r // group for r in rows[:: batch.share]]  # one prompt run per share
        real += sum(lengths.prompt[p] for p in prompts) + sum(lengths.completion[r] for r in rows)
        total += batch.tokens
    return 1.0 - real / total if total else 0.0
