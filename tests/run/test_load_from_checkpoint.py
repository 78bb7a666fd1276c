"""GRPOLightningModule.load_from_checkpoint: objects are never replaced by defaults, and a reward
given by import path is stored, loaded back and may not change on a resume."""

from __future__ import annotations

import pytest
from helpers.models import make_model, make_tokenizer
from helpers.rewards import varied

from forge_lightning.rewards.library import CompositeReward


@pytest.mark.integration
def test_load_from_checkpoint_never_stands_the_defaults_in_for_objects(
    tmp_path, module, trainer, loader, count_a
):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from forge_lightning.module import GRPOLightningModule

    def live(prompts, responses):  # a local function: no import path, so not stored
        return count_a(prompts, responses)

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit = trainer(tmp_path, max_steps=1, callbacks=[saver], enable_checkpointing=True)
    fit.fit(module(reward=live, gradient_accumulation_steps=1, kl_beta=0.0), loader([{"prompt": "q"}]))
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    with pytest.raises(
        ValueError, match=r"a model and a reward given as an object.*pass model=, reward= \(and tokenizer=\)"
    ):
        GRPOLightningModule.load_from_checkpoint(ckpt)
    tok = make_tokenizer()
    loaded = GRPOLightningModule.load_from_checkpoint(
        ckpt, model=make_model(len(tok)), tokenizer=tok, reward=live
    )
    assert loaded.reward is live and loaded.hparams.group_size == 4


@pytest.mark.integration
def test_a_reward_given_by_import_path_is_stored_and_a_resume_may_not_change_it(
    tmp_path, module, trainer, loader, count_a
):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from forge_lightning.examples.rewards import has_answer_line
    from forge_lightning.module import GRPOLightningModule
    from forge_lightning.rewards.library import FormatReward

    reward = CompositeReward([(count_a, 3.0, "a"), (FormatReward(has_answer_line), 1.0)])
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit = trainer(tmp_path, max_steps=1, callbacks=[saver], enable_checkpointing=True)
    fit.fit(module(reward=reward, kl_beta=0.0), loader([{"prompt": "q"}]))
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    with pytest.raises(ValueError, match=r"a model given as an object.*pass model= \(and tokenizer=\)"):
        GRPOLightningModule.load_from_checkpoint(ckpt)  # the model object, not the reward
    tok = make_tokenizer()
    loaded = GRPOLightningModule.load_from_checkpoint(ckpt, model=make_model(len(tok)), tokenizer=tok)
    assert loaded.reward.names == ["a", "FormatReward"] and loaded.reward.weights == [0.75, 0.25]
    assert loaded.reward.rewards[0] is count_a and loaded.reward.rewards[1].format_fn is has_answer_line
    changed = module(reward=CompositeReward([(count_a, 1.0, "a"), (varied, 1.0)]), kl_beta=0.0)
    with pytest.raises(ValueError, match=r"(?s)differ from the checkpoint's.*reward: \{'class_path'"):
        trainer(tmp_path, max_steps=2).fit(changed, loader([{"prompt": "q"}]), ckpt_path=ckpt)
