"""PromptDataModule batches, its seeded per-epoch shuffle, the mock split, and argument checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from forge_lightning.data import EpochShuffleSampler, PromptDataModule, collate_records, load_gsm8k_mock


def mock_module(**kwargs: Any) -> PromptDataModule:
    dm = PromptDataModule(source="mock", **kwargs)
    dm.setup("fit")
    return dm


def epoch_order(dm: PromptDataModule, epoch: int) -> list[str]:
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return [prompt for batch in loader for prompt in batch["prompt"]]


def test_train_batches_are_dicts_of_lists_with_last_batch_kept() -> None:
    dm = mock_module(prompts_per_step=5)
    batches = list(dm.train_dataloader())
    assert [len(b["prompt"]) for b in batches] == [5, 5, 5, 1]
    assert all(set(b) == {"prompt", "reference"} and len(b["reference"]) == len(b["prompt"]) for b in batches)
    assert isinstance(batches[0]["prompt"][0], str)


def test_val_batches_are_in_file_order() -> None:
    dm = mock_module(val_batch_size=3)
    batches = list(dm.val_dataloader())
    assert [len(b["prompt"]) for b in batches] == [3, 1]
    assert [r for b in batches for r in b["reference"]] == [s["reference"] for s in load_gsm8k_mock()[-4:]]


def test_mock_split_is_16_train_4_validation_without_overlap() -> None:
    dm = mock_module()
    train = {p for b in dm.train_dataloader() for p in b["prompt"]}
    val = {p for b in dm.val_dataloader() for p in b["prompt"]}
    assert (dm.train_size, len(train), len(val)) == (16, 16, 4)
    assert not train & val


def test_mock_split_honours_sample_caps() -> None:
    dm = mock_module(max_samples=5, val_max_samples=2)
    assert dm.train_size == 5
    assert sum(len(b["prompt"]) for b in dm.val_dataloader()) == 2


def test_same_seed_and_epoch_give_same_order_other_epoch_differs() -> None:
    first, second = mock_module(seed=7), mock_module(seed=7)
    assert epoch_order(first, 0) == epoch_order(second, 0)
    assert epoch_order(first, 1) == epoch_order(second, 1)
    assert epoch_order(first, 0) != epoch_order(first, 1)
    assert sorted(epoch_order(first, 0)) == sorted(epoch_order(first, 1))
    assert epoch_order(first, 0) != epoch_order(mock_module(seed=8), 0)


def test_shuffle_off_keeps_file_order() -> None:
    dm = mock_module(shuffle=False)
    expected = [s["prompt"] for s in load_gsm8k_mock()[:16]]
    assert epoch_order(dm, 0) == epoch_order(dm, 3) == expected


def test_sampler_order_is_randperm_seeded_by_seed_plus_epoch() -> None:
    sampler = EpochShuffleSampler(10, seed=3)
    sampler.set_epoch(2)
    assert list(sampler) == torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()
    assert len(sampler) == 10


def test_collate_keeps_extra_keys_and_rejects_mixed_keys() -> None:
    batch = collate_records(
        [{"prompt": "a", "reference": "1", "id": 0}, {"prompt": "b", "reference": "2", "id": 1}]
    )
    assert batch == {"prompt": ["a", "b"], "reference": ["1", "2"], "id": [0, 1]}
    with pytest.raises(ValueError, match="share keys"):
        collate_records([{"prompt": "a"}, {"prompt": "b", "id": 1}])


def test_local_source_reads_train_and_test_files(tmp_path: Path) -> None:
    for split, count in (("train", 6), ("test", 3)):
        rows = [{"question": f"{split} {i}?", "answer": f"#### {i}"} for i in range(count)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = PromptDataModule(source="local", path=str(tmp_path), max_samples=4, val_max_samples=None)
    dm.setup("fit")
    assert dm.train_size == 4
    assert [r for b in dm.val_dataloader() for r in b["reference"]] == ["0", "1", "2"]


def test_local_rows_with_a_prompt_field_and_no_question_are_read_by_it(tmp_path: Path) -> None:
    rows = [{"prompt": f"What is {i} + 1?", "reference": str(i + 1), "level": i} for i in range(3)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = PromptDataModule(source="local", path=str(tmp_path / "tasks.jsonl"), val_batch_size=3)
    dm.setup("fit")
    [batch] = list(dm.val_dataloader())  # a single file serves both splits, in file order
    assert batch == {"prompt": [r["prompt"] for r in rows], "reference": ["1", "2", "3"], "level": [0, 1, 2]}
    assert dm.train_size == 3


def test_local_rows_with_both_question_and_prompt_are_gsm8ks_and_say_so(tmp_path: Path) -> None:
    row = {"question": "Two and two?", "answer": "2 + 2 = 4\n#### 4", "prompt": "ignored"}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps(row) + "\n")
    dm = PromptDataModule(source="local", path=str(tmp_path))
    said = r"train.jsonl: its rows have both a 'question' and a 'prompt' field; reading 'question'"
    with pytest.warns(UserWarning, match=rf"{said}.*set data.prompt_field to prompt"):
        dm.setup("fit")
    [batch] = list(dm.val_dataloader())
    assert batch["reference"] == ["4"] and "Problem: Two and two?" in batch["prompt"][0]


def test_local_source_on_real_gsm8k(gsm8k_dir: Path) -> None:
    dm = PromptDataModule(source="local", path=str(gsm8k_dir), max_samples=None, val_max_samples=10)
    dm.setup("fit")
    assert dm.train_size == 7473
    assert sum(len(b["prompt"]) for b in dm.val_dataloader()) == 10


def test_data_is_needed_before_use() -> None:
    with pytest.raises(RuntimeError, match="setup"):
        _ = PromptDataModule(source="mock").train_size


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"source": "web"}, "source"),
        ({"source": "local"}, "path"),
        ({"source": "mock", "path": "/x"}, "path"),
        ({"max_samples": 0}, "max_samples"),
        ({"val_max_samples": -1}, "val_max_samples"),
        ({"prompts_per_step": 0}, "prompts_per_step"),
        ({"val_batch_size": 0}, "val_batch_size"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_constructor_errors_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PromptDataModule(**kwargs)


class RecordPrompts(L.LightningModule):
    """Records the prompts each epoch sees; a single parameter keeps the optimizer happy."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: dict[int, list[str]] = {}

    def training_step(self, batch: dict[str, list[str]], batch_idx: int) -> torch.Tensor:
        self.seen.setdefault(self.current_epoch, []).extend(batch["prompt"])
        return self.weight * 0.0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.integration
def test_lightning_sets_the_epoch_on_the_sampler(tmp_path: Path) -> None:
    dm = PromptDataModule(source="mock", prompts_per_step=4, seed=11)
    model = RecordPrompts()
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=dm)
    reference = mock_module(seed=11)
    assert model.seen[0] == epoch_order(reference, 0)
    assert model.seen[1] == epoch_order(reference, 1)


def test_a_batch_default_collate_transposed_or_left_unbatched_names_collate_records() -> None:
    import forge_lightning
    from forge_lightning.data.datamodule import split_batch

    conversations = [
        {"prompt": [{"role": "user", "content": "hi"}], "reference": "a"},
        {"prompt": [{"role": "user", "content": "yo"}], "reference": "b"},
    ]
    hint = r"DataLoader\(dataset, batch_size=N, collate_fn=forge_lightning\.data\.collate_records\)"
    transposed = next(iter(torch.utils.data.DataLoader(conversations, batch_size=2)))
    with pytest.raises(ValueError, match="default collate transposed a batch of conversations.*" + hint):
        split_batch(transposed)
    with pytest.raises(ValueError, match="is one conversation.*" + hint):
        split_batch(conversations[0])
    with pytest.raises(ValueError, match="is one str.*" + hint):
        split_batch({"prompt": "What is 2 + 2?"})
    prompts, kwargs = split_batch(forge_lightning.collate_records(conversations))
    assert prompts == [row["prompt"] for row in conversations] and kwargs == {"references": ["a", "b"]}


class RecordValidation(RecordPrompts):
    def __init__(self) -> None:
        super().__init__()
        self.validated: list[str] = []

    def validation_step(self, batch: dict[str, list[str]], batch_idx: int) -> None:
        self.validated.extend(batch["prompt"])


def quiet_trainer(root: Path, **kwargs: Any) -> L.Trainer:
    quiet = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return L.Trainer(accelerator="cpu", default_root_dir=root, num_sanity_val_steps=0, **{**quiet, **kwargs})


@pytest.mark.integration
def test_a_datasets_dataset_trains_validates_and_resumes_only_on_the_same_rows(tmp_path: Path) -> None:
    import datasets

    rows = [{"text": f"Say {i}", "label": i} for i in range(4)]
    prompts = [row["text"] for row in rows]

    def data(rows: list[dict[str, Any]]) -> PromptDataModule:
        return PromptDataModule(dataset=datasets.Dataset.from_list(rows), prompt_field="text", shuffle=False)

    first, model = data(rows), RecordValidation()
    every_2 = L.pytorch.callbacks.ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=2, save_top_k=-1)
    quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[every_2]).fit(
        model, datamodule=first
    )
    assert model.seen[0] == model.validated == prompts  # one Dataset serves train and validation
    assert first._train[0] == {"prompt": "Say 0", "label": 0}
    # The same rows loaded again resume where the checkpoint was written; other rows are refused.
    resumed, step_2 = RecordValidation(), tmp_path / "step=2.ckpt"
    quiet_trainer(tmp_path, max_epochs=1).fit(resumed, datamodule=data(rows), ckpt_path=step_2)
    assert resumed.seen == {0: prompts[2:]}
    with pytest.raises(ValueError, match=r"data settings that differ.*\n  dataset: 'datasets.Dataset "):
        quiet_trainer(tmp_path, max_epochs=1).fit(
            RecordValidation(), datamodule=data(rows[:3]), ckpt_path=step_2
        )


def test_a_gsm8k_datasetdict_gives_its_train_and_test_splits() -> None:
    import datasets

    splits = {
        split: datasets.Dataset.from_list(
            [{"question": f"{split} {i}?", "answer": f"#### {i}"} for i in range(n)]
        )
        for split, n in (("train", 3), ("test", 2))
    }
    data = PromptDataModule(dataset=datasets.DatasetDict(splits))
    data.setup("fit")
    assert data.train_size == 3 and [r for b in data.val_dataloader() for r in b["reference"]] == ["0", "1"]
    assert "Problem: test 0?" in data._val[0]["prompt"]
    with pytest.raises(ValueError, match=r"no 'dev' split \(splits: \['test', 'train'\]\)"):
        PromptDataModule(dataset=datasets.DatasetDict(splits), val_split="dev").setup("fit")


def test_a_dataset_that_cannot_be_read_is_refused_by_name() -> None:
    import datasets

    with pytest.raises(
        TypeError, match=r"datasets\.Dataset or a datasets\.DatasetDict, got list.*collate_records"
    ):
        PromptDataModule(dataset=[{"prompt": "a"}])
    with pytest.raises(ValueError, match=r"leave source at 'hub', got 'mock'"):
        PromptDataModule(dataset=datasets.Dataset.from_list([{"prompt": "a"}]), source="mock")
