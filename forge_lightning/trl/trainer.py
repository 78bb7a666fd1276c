"""TRL's ``GRPOTrainer`` on this package: ``from forge_lightning.trl import GRPOConfig, GRPOTrainer``
and a TRL script runs with that one import changed.

Nothing here trains by itself: the TRL arguments are mapped onto a ``GRPOLightningModule``, a
``PromptDataModule`` over the dataset and a Lightning ``Trainer`` (trl/settings.py,
trl/lightning.py), which do the work as they do from the CLI.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from transformers import PreTrainedModel, TrainerCallback
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.trainer_utils import TrainOutput

from forge_lightning.data.datamodule import PromptDataModule
from forge_lightning.models.lora import has_adapter, lora_settings
from forge_lightning.module import GRPOLightningModule
from forge_lightning.rewards.reward_model import RewardModel
from forge_lightning.run.folder import RunFolder
from forge_lightning.trl.callbacks import TrainerStateCallback
from forge_lightning.trl.config import GRPOConfig
from forge_lightning.trl.lightning import CHECKPOINTS, run_folder, trainer_settings, world_size
from forge_lightning.trl.script import by_path
from forge_lightning.trl.settings import (
    batch_shape,
    data_settings,
    module_settings,
    optimizer_steps,
)

# Lightning's warning that a ModelCheckpoint under manual optimization saves the weights before the
# step: the module steps inside training_step, so the checkpoint holds the state after it.
_PRE_STEP_STATE_WARNING = r"Using ModelCheckpoint with manual optimization and every_n_train_steps"


class GRPOTrainer:
    """TRL's ``GRPOTrainer`` arguments, trained by ``GRPOLightningModule`` in a Lightning ``Trainer``.

    Args:
        model: a hub id or folder (loaded as ``model_init_kwargs`` say), or a built causal LM.
        reward_funcs: a reward function (TRL's ``(completions, **kwargs)`` or this package's), a
            reward model's id or folder, a built one (with its ``reward_processing_classes``), or a
            list of them, weighted by ``args.reward_weights``.
        args: TRL's configuration; None: TRL's defaults with ``output_dir="<model name>-GRPO"``.
        train_dataset: a ``datasets.Dataset`` (or a list of dicts) with a ``prompt`` column, text or
            a conversation; every other column reaches the rewards by name.
        eval_dataset: the same form, validated as ``args.eval_strategy`` says.
        processing_class: the tokenizer; None: the model's own.
        reward_processing_classes: the tokenizers of reward models given as built models.
        callbacks: Lightning callbacks, or transformers ``TrainerCallback`` objects (or classes),
            called with TRL's ``state`` at each step, log, save and the train's begin and end.
        peft_config: a ``peft.LoraConfig``: train a LoRA adapter.
        tools: typed functions with Google-style docstrings a completion may call.
        environment_factory: a class, or a function returning an environment, made per completion;
            or a mapping name -> factory picked by each row's ``environment`` column.

    Tools and environment factories defined in the script itself (``__main__``) are made
    importable under ``forge_lightning.trl.script`` in this process (trl/script.py), so a resume
    from the same script finds them; a reward defined there is kept by value.
    """

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Any] | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ) -> None:
        _refuse(optimizers != (None, None), "optimizers", "the module builds its AdamW and schedule")
        _refuse(quantization_config is not None, "quantization_config", "quantized loading is not supported")
        _refuse(rollout_func is not None, "rollout_func", "use environment_factory, or the module's agent")
        _check_policy_and_rewards(model, peft_config, reward_funcs, environment_factory)
        self.args = args = args or GRPOConfig(f"{_model_name(model)}-GRPO")
        world = world_size()
        shape = batch_shape(args, world)
        train = _dataset(train_dataset, "train_dataset")
        evaluates = eval_dataset is not None and args.eval_strategy != "no"
        total = optimizer_steps(args, shape, len(train), world)
        self.module = GRPOLightningModule(
            model=model,
            tokenizer=processing_class or _own_tokenizer(model),
            reward=_rewards(reward_funcs, args.reward_weights, reward_processing_classes),
            peft=lora_settings(peft_config),
            tools=[by_path(tool) for tool in tools] if tools else None,
            environment_factory=_factories(environment_factory),
            use_chat_template=_conversational(train),
            **module_settings(args, shape, total, evaluates),
        )
        data = train if not evaluates else _with_eval(train, _dataset(eval_dataset, "eval_dataset"))
        self.datamodule = PromptDataModule(dataset=data, **data_settings(args, shape))
        given = list(callbacks or [])
        hf_callbacks = [c for c in given if _is_transformers_callback(c)]
        self.state_callback = TrainerStateCallback(args, hf_callbacks, max_steps=total)
        settings = trainer_settings(args, shape, total, evaluates)
        own = [c for c in given if not _is_transformers_callback(c)]
        settings["callbacks"] += [self.state_callback, *own]
        self.trainer = pl.Trainer(**settings)

    @property
    def model(self) -> PreTrainedModel | None:
        """The policy (None before ``train()`` loads a model given by name)."""
        return self.module.model

    @property
    def processing_class(self) -> PreTrainedTokenizerBase | None:
        return self.module.tokenizer

    @property
    def state(self) -> Any:
        """transformers' ``TrainerState`` of the run: ``global_step``, ``epoch``, ``log_history``."""
        return self.state_callback.state

    def train(
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any
    ) -> TrainOutput:
        """Fit, from a checkpoint when asked (True: the run folder's newest ``last.ckpt``; a path:
        that ``.ckpt`` file, or a folder's newest), and return TRL's ``TrainOutput``."""
        _refuse(trial is not None, "trial", "hyper-parameter search is not supported")
        _refuse(bool(kwargs), ", ".join(kwargs), "train() takes resume_from_checkpoint only")
        ckpt_path = self._checkpoint(resume_from_checkpoint)
        pl.seed_everything(self.args.seed, verbose=False)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PRE_STEP_STATE_WARNING, category=UserWarning)
            self.trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=ckpt_path)
        loss = self.state_callback.training_loss
        metrics = {
            "train_runtime": time.perf_counter() - start,
            "train_loss": loss,
            "epoch": self.state.epoch,
        }
        return TrainOutput(self.trainer.global_step, loss, metrics)

    def save_model(self, output_dir: str | None = None) -> None:
        """The policy and tokenizer with ``save_pretrained`` in ``output_dir`` (None: the run folder);
        a LoRA policy saves its adapter. The run writes ``final/`` by itself as well."""
        folder = Path(output_dir) if output_dir is not None else run_folder(self.args)
        if self.trainer.is_global_zero:
            self.module.model.save_pretrained(folder)
            self.module.tokenizer.save_pretrained(folder)

    def _checkpoint(self, resume: str | bool | None) -> str | None:
        if resume is None or resume is False:
            return None
        root = run_folder(self.args)
        if resume is True:
            found = RunFolder(root, [root / CHECKPOINTS]).newest_checkpoint()
            if found is None:
                raise ValueError(f"No valid checkpoint found in output directory ({root})")
            return str(found)
        path = Path(resume)
        found = path if path.is_file() else RunFolder(path, [path, path / CHECKPOINTS]).newest_checkpoint()
        if found is None:
            raise ValueError(f"Can't find a valid checkpoint at {resume}")
        return str(found)


def _refuse(given: bool, name: str, why: str) -> None:
    if given:
        raise ValueError(f"GRPOTrainer({name}=...) is refused: {why}")


def _check_policy_and_rewards(
    model: Any, peft_config: Any, reward_funcs: Any, environment_factory: Any
) -> None:
    if peft_config is not None and has_adapter(model):
        raise ValueError(
            "You passed a PeftModel instance together with a peft_config: merge and unload its adapter "
            "first, or pass the PeftModel alone"
        )
    if reward_funcs is None and environment_factory is None:
        raise ValueError("reward_funcs is required (or an environment_factory whose environments score)")


def _model_name(model: str | PreTrainedModel) -> str:
    name = model if isinstance(model, str) else model.config._name_or_path
    return name.rstrip("/").split("/")[-1]


def _own_tokenizer(model: str | PreTrainedModel) -> PreTrainedTokenizerBase | None:
    """None for a model given by name (loaded with it); a built model's from where it came."""
    if isinstance(model, str):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.config._name_or_path)


def _dataset(rows: Any, name: str) -> Any:
    """``rows`` as a ``datasets.Dataset`` with a ``prompt`` column."""
    import datasets

    if rows is None:
        raise ValueError(f"{name} is required: a datasets.Dataset with a 'prompt' column")
    if isinstance(rows, list):
        rows = datasets.Dataset.from_list(rows)
    if not isinstance(rows, datasets.Dataset):
        raise TypeError(
            f"{name} takes a datasets.Dataset (or a list of dicts) here, got {type(rows).__name__}: an "
            "IterableDataset has no length to size the schedule from, and a dict of datasets is one per split"
        )
    if "prompt" not in rows.column_names:
        raise ValueError(f"{name} has no 'prompt' column: its columns are {rows.column_names}")
    return rows


def _conversational(rows: Any) -> bool:
    """Whether the prompts are conversations: TRL puts those through the chat template, text as it is."""
    return len(rows) > 0 and isinstance(rows[0]["prompt"], list)


def _with_eval(train: Any, evaluation: Any) -> Any:
    import datasets

    return datasets.DatasetDict({"train": train, "test": evaluation})


def _rewards(funcs: Any, weights: list[float] | None, processing_classes: Any) -> Any:
    """TRL's ``reward_funcs`` as the module's ``reward``: one reward, or ``(reward, weight)`` pairs."""
    if funcs is None:
        return None
    funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
    classes = (
        processing_classes if isinstance(processing_classes, list) else [processing_classes] * len(funcs)
    )
    if len(classes) != len(funcs):
        raise ValueError(
            f"The number of reward processing classes ({len(classes)}) must match the number of reward "
            f"functions ({len(funcs)})."
        )
    built = [_reward(f, tokenizer) for f, tokenizer in zip(funcs, classes)]
    if weights is None:
        return built[0] if len(built) == 1 else built
    if len(weights) != len(built):
        raise ValueError(
            f"Number of reward weights ({len(weights)}) must match number of reward functions ({len(built)})"
        )
    return [(fn, float(w)) for fn, w in zip(built, weights)]


def _reward(func: Any, tokenizer: Any) -> Any:
    """A reward model's id or folder, or a built one, as a RewardModel; a function as it is."""
    if isinstance(func, str):
        return RewardModel(func)
    if isinstance(func, PreTrainedModel):
        return RewardModel(func, tokenizer=tokenizer or _own_tokenizer(func))
    return func


def _factories(factory: Any) -> Any:
    if isinstance(factory, dict):
        return {name: by_path(f) for name, f in factory.items()}
    return None if factory is None else by_path(factory)


def _is_transformers_callback(callback: Any) -> bool:
    kind = callback if isinstance(callback, type) else type(callback)
    return issubclass(kind, TrainerCallback)
