"""GSM8K as a LightningDataModule: batches of formatted prompts with their reference answers."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal, get_args

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.utils.data import DataLoader, Sampler
from typing_extensions import override

from forge_lightning.data.arithmetic import DEFAULT_VARIANT, VARIANTS, generate
from forge_lightning.data.arithmetic_unseen import generate_unseen, require_unseen
from forge_lightning.data.epoch_sampler import EpochShuffleSampler
from forge_lightning.data.gsm8k import load_gsm8k, load_gsm8k_mock
from forge_lightning.data.readers import load_prompts, local_prompt_field, require_in_memory
from forge_lightning.run.resume import changed_settings

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

Source = Literal["hub", "local", "mock", "arithmetic"]
ValPart = Literal["heldout", "dev", "unseen"]
# The 20 mock problems split at a fixed point so train and validation never share a problem.
MOCK_VAL_SIZE = 4


def collate_records(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``[{"prompt": p, "reference": r, ...}, ...]`` -> ``{"prompt": [p, ...], "reference": [r, ...], ...}``.

    Values stay Python objects (no tensors): prompts are tokenized later, per rollout.
    """
    keys = list(records[0]) if records else []
    for record in records:
        if list(record) != keys:
            raise ValueError(f"records in one batch must share keys; got {sorted(record)} and {sorted(keys)}")
    return {key: [record[key] for record in records] for key in keys}


def split_batch(batch: dict[str, Any]) -> tuple[list[str], dict[str, list[Any]]]:
    """Prompts, and the keyword arguments each reward may take (``reference`` -> ``references``)."""
    if "prompt" not in batch:
        raise KeyError(f"a batch needs a 'prompt' key (list of str); got keys {sorted(batch)}")
    prompts = _batched_prompts(batch["prompt"])
    kwargs: dict[str, list[Any]] = {}
    for key, values in batch.items():
        if key == "prompt":
            continue
        values = values.tolist() if isinstance(values, Tensor) else list(values)
        if len(values) != len(prompts):
            raise ValueError(f"batch key {key!r} has {len(values)} values for {len(prompts)} prompts")
        kwargs["references" if key == "reference" else key] = values
    return prompts, kwargs


_COLLATE_HINT = "DataLoader(dataset, batch_size=N, collate_fn=forge_lightning.data.collate_records)"


def _batched_prompts(value: Any) -> list[Any]:
    """The batch's prompts, each text or a conversation; ValueError when the dataloader did not
    batch rows the way the module reads them (the mistakes that would otherwise train on garbage)."""
    if isinstance(value, str):
        # Iterating it would make each character a prompt.
        raise ValueError(
            f"batch['prompt'] is one str, not a list of prompts: the dataloader yields single rows "
            f"(a dataset passed to trainer.fit as it is). Batch it: {_COLLATE_HINT}"
        )
    prompts = list(value)
    for prompt in prompts:
        if isinstance(prompt, dict) and any(isinstance(v, (list, tuple)) for v in prompt.values()):
            # torch's default_collate turns a batch of conversations into one list of messages
            # whose fields are lists (one entry per prompt).
            raise ValueError(
                "batch['prompt'] holds messages whose fields are lists: torch's default collate "
                f"transposed a batch of conversations. Use {_COLLATE_HINT}"
            )
        if isinstance(prompt, dict):
            raise ValueError(
                "batch['prompt'] is one conversation, not a list of prompts: the dataloader yields "
                f"single rows. Batch it: {_COLLATE_HINT}"
            )
    return prompts


class PromptDataModule(L.LightningDataModule):
    """Prompts for GRPO: train from the train split, validation (and ``trainer.predict``) from the
    test split. GSM8K's by default; any prompt dataset with ``prompt_field`` (a local
    JSON-lines/parquet/CSV folder or file, or a hub dataset by name).

    Args:
        source: "hub" downloads ``openai/gsm8k``; "local" reads ``path``; "mock" uses the 20
            built-in problems (last 4 for validation) and needs no network or files;
            "arithmetic" generates the seeded word problems of ``data/arithmetic.py`` in memory
            (the parts of ``task_variant``, seeded by ``task_seed``): train on the train part,
            validate on the part ``val_part`` names.
        path: folder with ``train``/``test`` ``.jsonl``, ``.parquet`` or ``.csv`` files (or one
            file, used for both); only for source="local".
        max_samples: training prompts to keep (the first ones in file order); None keeps all.
        val_max_samples: validation prompts to keep (the first ones); None keeps all.
        prompts_per_step: prompts per training batch, i.e. per ``training_step`` (not per optimizer
            step: with gradient accumulation or a generation split into several steps the two differ; the name
            is kept as the flag configs and checkpoints use).
        val_batch_size: prompts per validation batch.
        shuffle: reshuffle the training prompts every epoch.
        seed: seed of the shuffle; epoch ``e`` uses ``seed + e``.
        skip_malformed: skip malformed rows with a warning instead of failing.
        num_workers: DataLoader worker processes.
        prompt_field: read rows of any dataset instead of GSM8K's: this field is the prompt (text,
            or a conversation as a list of ``{"role", "content"}`` messages, which goes through the
            chat template as it is); every other field goes to the rewards under its name. None:
            GSM8K's ``question``/``answer``, or with source="local" rows that have a ``prompt``
            field and no ``question``, that field.
        reference_field: with ``prompt_field``, a field to give the rewards as ``references`` (and
            the ``val/accuracy`` check); None: a field named ``reference`` is that already.
        dataset: with source="hub" (the default), rows other than the hub's GSM8K: a hub
            dataset's name (with ``prompt_field``), or a ``datasets.Dataset`` (read for train and
            validation, as a single local file is) or ``datasets.DatasetDict`` (its ``train`` and
            ``val_split`` splits) already loaded, with GSM8K's fields or ``prompt_field``'s.
        val_split: the split (or file stem) validation reads; "test" by default.
        task_variant: with source="arithmetic", which problems (a ``data.arithmetic.VARIANTS`` name).
        val_part: with source="arithmetic", the part validation reads: "heldout" (measured once, at
            the end), "dev" (to choose settings on) or "unseen" (the multistep variants' trained
            shapes in wordings no train part uses, ``data/arithmetic_unseen.py``).
        worked_solutions: with source="arithmetic", give the rewards each problem's worked
            solution (one ``expression = result`` line a step) as ``solution``, for a reward that
            credits the steps (``rewards.intermediate.IntermediateResultsReward``).
    """

    def __init__(
        self,
        source: Source = "hub",
        path: str | None = None,
        max_samples: int | None = 500,
        val_max_samples: int | None = 100,
        prompts_per_step: int = 1,
        val_batch_size: int = 8,
        shuffle: bool = True,
        seed: int = 42,
        skip_malformed: bool = False,
        num_workers: int = 0,
        task_seed: int = 0,
        val_part: ValPart = "heldout",
        prompt_field: str | None = None,
        reference_field: str | None = None,
        dataset: str | Dataset | DatasetDict | None = None,
        val_split: str = "test",
        task_variant: str = DEFAULT_VARIANT,
        worked_solutions: bool = False,
    ) -> None:
        super().__init__()
        _validate(source, path, max_samples, val_max_samples, prompts_per_step, val_batch_size, num_workers)
        self.source = source
        self.path = path
        self.max_samples = max_samples
        self.val_max_samples = val_max_samples
        self.prompts_per_step = prompts_per_step
        self.val_batch_size = val_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.skip_malformed = skip_malformed
        self.num_workers = num_workers
        self.task_seed = task_seed
        self.val_part = val_part
        self.task_variant = task_variant
        self.worked_solutions = worked_solutions
        if worked_solutions and source != "arithmetic":
            raise ValueError(
                f"worked_solutions gives the arithmetic task's workings, not source={source!r}'s: "
                "another dataset's rows give a solution column under its own name (prompt_field; "
                "IntermediateResultsReward's solution_field names it)"
            )
        arithmetic = (task_seed, val_part, task_variant) != (0, "heldout", DEFAULT_VARIANT)
        if source != "arithmetic" and arithmetic:
            # A config written for the arithmetic task (smoke.yaml) run with --data.source local:
            # its task settings have nothing to act on.
            warnings.warn(
                f"task_seed, task_variant and val_part are settings of source='arithmetic'; "
                f"ignored with source={source!r}",
                stacklevel=2,
            )
        if task_variant not in VARIANTS:
            raise ValueError(f"task_variant must be one of {sorted(VARIANTS)}, got {task_variant!r}")
        if val_part not in get_args(ValPart):
            raise ValueError(f"val_part must be one of {get_args(ValPart)}, got {val_part!r}")
        if source == "arithmetic" and val_part == "unseen":
            require_unseen(task_variant)
        self.prompt_field = prompt_field
        self.reference_field = reference_field
        self.dataset = dataset
        self.val_split = val_split
        _check_dataset(dataset, source)
        if prompt_field is None and isinstance(dataset, str):
            raise ValueError("dataset names a hub dataset of prompts: set prompt_field too")
        if prompt_field is not None and source not in ("local", "hub"):
            raise ValueError(f"prompt_field reads a local or hub dataset, not source={source!r}")
        if prompt_field is not None and source == "hub" and dataset is None:
            raise ValueError("source='hub' with prompt_field needs dataset= (the hub dataset's name)")
        self._train: list[dict[str, str]] | None = None
        self._val: list[dict[str, str]] | None = None
        self._resume: dict[str, int] | None = None

    @override
    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return  # Lightning calls setup once per stage; the data only needs loading once.
        if self.source == "mock":
            problems = load_gsm8k_mock()
            self._train = problems[:-MOCK_VAL_SIZE][: self.max_samples]
            self._val = problems[-MOCK_VAL_SIZE:][: self.val_max_samples]
            return
        if self.source == "arithmetic":
            parts = generate(seed=self.task_seed, variant=self.task_variant)
            if self.val_part == "unseen":  # its own draw, apart from (and after) the other parts
                parts = {**parts, "unseen": generate_unseen(self.task_seed, self.task_variant, parts)}
            records = {
                part: [p.sample(self.worked_solutions) for p in problems] for part, problems in parts.items()
            }
            self._train = records["train"][: self.max_samples]
            self._val = records[self.val_part][: self.val_max_samples]
            return
        prompt_field = self.prompt_field
        if prompt_field is None and self.source == "local":
            prompt_field = local_prompt_field(self.path, "train")  # a `prompt` field, not GSM8K's
        if prompt_field is not None:
            self._train, self._val = (
                load_prompts(
                    split,
                    limit,
                    prompt_field=prompt_field,
                    reference_field=self.reference_field,
                    path=self.path,
                    dataset=self.dataset,
                    skip_malformed=self.skip_malformed,
                )
                for split, limit in (("train", self.max_samples), (self.val_split, self.val_max_samples))
            )
            return
        self._train, self._val = (
            load_gsm8k(split, limit, self.path, self.skip_malformed, dataset=self.dataset)
            for split, limit in (("train", self.max_samples), (self.val_split, self.val_max_samples))
        )

    @override
    def train_dataloader(self) -> DataLoader:
        train = self._loaded(self._train)
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        sampler = EpochShuffleSampler(len(train), self.seed, self.shuffle, num_replicas=world, rank=rank)
        if self._resume is not None:
            sampler.resume_at(self._resume["epoch"], self._resume["batches_done"] * self.prompts_per_step)
            self._resume = None
        return self._loader(train, self.prompts_per_step, sampler)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The data position, saved in Lightning checkpoints: epoch and batches already trained,
        with the settings that decide which prompts those are."""
        if self.trainer is None:
            return {}
        # ``ready`` counts the batch being finished when a checkpoint is written at batch end.
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.ready
        return {"epoch": self.trainer.current_epoch, "batches_done": done, "settings": self._settings()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.trainer is not None and self.trainer.state.fn == TrainerFn.FITTING:
            self.check_resume(state_dict)  # validate may read other data
        self._resume = {"epoch": state_dict["epoch"], "batches_done": state_dict["batches_done"]}

    def resume_changes(self, state_dict: dict[str, Any]) -> list[str]:
        """``name: old -> new`` for each setting that differs from the checkpoint's ``state_dict``
        and would make its data position point at other prompts."""
        return list(changed_settings(state_dict.get("settings", {}), self._settings()).values())

    def check_resume(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError naming each of :meth:`resume_changes`."""
        changed = self.resume_changes(state_dict)
        if changed:
            raise ValueError(
                "resuming with data settings that differ from the checkpoint's (the data position "
                "would point at other prompts):\n  " + "\n  ".join(changed) + "\nRun with the original "
                "settings, or start a new run in a new folder"
            )

    def _settings(self) -> dict[str, Any]:
        names = ("source", "path", "max_samples", "prompts_per_step", "shuffle", "seed", "task_seed")
        names += ("prompt_field", "task_variant")
        return {name: getattr(self, name) for name in names} | {"dataset": _dataset_setting(self.dataset)}

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self._loaded(self._val), self.val_batch_size, None)

    @override
    def predict_dataloader(self) -> DataLoader:
        """What ``trainer.predict`` completes: the validation prompts (``val_split``'s, up to
        ``val_max_samples``), ``val_batch_size`` a batch, in order."""
        return self.val_dataloader()

    @property
    def train_size(self) -> int:
        """Number of training prompts (after ``setup``)."""
        return len(self._loaded(self._train))

    def _loaded(self, split: list[dict[str, str]] | None) -> list[dict[str, str]]:
        if split is None:
            raise RuntimeError("PromptDataModule.setup() must run before its data is used")
        return split

    def _loader(
        self, data: list[dict[str, str]], batch_size: int, sampler: Sampler[int] | None
    ) -> DataLoader:
        return DataLoader(
            data,  # a list is already a map-style dataset
            batch_size=batch_size,
            sampler=sampler,
            drop_last=False,
            collate_fn=collate_records,
            num_workers=self.num_workers,
            # Its own generator: otherwise every new iterator draws from the global RNG, and a
            # resumed run would sample different completions from an uninterrupted one.
            generator=torch.Generator().manual_seed(self.seed),
        )


def _check_dataset(dataset: Any, source: str) -> None:
    if dataset is None or isinstance(dataset, str):
        return
    require_in_memory(dataset)
    if source != "hub":
        raise ValueError(
            f"dataset= a {type(dataset).__name__} is read in memory: leave source at 'hub', got {source!r}"
        )


def _dataset_setting(dataset: Any) -> str | None:
    """What a checkpoint records of ``dataset``: its name, or the content fingerprint of each
    in-memory split (datasets' own hash of the rows), so resuming on other rows is refused."""
    if dataset is None or isinstance(dataset, str):
        return dataset
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        splits = ", ".join(f"{name}: {fingerprint(split)}" for name, split in sorted(dataset.items()))
        return f"datasets.DatasetDict {splits}"
    return f"datasets.Dataset {fingerprint(dataset)}"


def fingerprint(dataset: Any) -> str:
    """A ``datasets.Dataset``'s hash of its rows and the transforms that made them.

    Private: datasets keeps it in ``_fingerprint`` (what its own cache keys on) and has no public
    accessor. Checked on datasets 2.19.0 and 5.2.0; tests/test_private_api.py fails if it moves."""
    return dataset._fingerprint


def _validate(
    source: str,
    path: str | None,
    max_samples: int | None,
    val_max_samples: int | None,
    prompts_per_step: int,
    val_batch_size: int,
    num_workers: int,
) -> None:
    if source not in get_args(Source):
        raise ValueError(f"source must be one of {get_args(Source)}, got {source!r}")
    if source == "local" and path is None:
        raise ValueError("path is required when source='local'")
    if source != "local" and path is not None:
        raise ValueError(f"path is only used with source='local', but source={source!r}")
    for field, value in (("max_samples", max_samples), ("val_max_samples", val_max_samples)):
        if value is not None and value < 1:
            raise ValueError(f"{field} must be >= 1 or None, got {value}")
    for field, value in (("prompts_per_step", prompts_per_step), ("val_batch_size", val_batch_size)):
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")


GSM8KDataModule = PromptDataModule  # its first name: it loads GSM8K by default, and any prompts
