"""TRL scripts run with only their import line changed (``from forge_lightning.trl import``), run as
a script is (``__main__``), offline: ``load_dataset`` and the hub model are swapped for tiny
in-memory ones by the test (``models/loading.py``'s hub loader, test-only)."""

from __future__ import annotations

import pytest
from helpers.models import make_model, make_tokenizer

from forge_lightning.testing import tiny_policy

# TRL's quickstart, docs/source/grpo_trainer.md of huggingface/trl (as of 2025-08, before e7b37d4e8
# moved it to DeepMath and accuracy_reward), word for word.
QUICKSTART = """\
# train_grpo.py
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/tldr", split="train")

# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO")
trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
"""

# A script with a tool of its own, run for MAX_STEPS steps, resumed when RESUME is True.
AGENT_SCRIPT = '''\
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

def count_letter(word: str, letter: str) -> int:
    """Count how many times a letter occurs in a word.

    Args:
        word: The word to look in.
        letter: The letter to count.
    """
    return word.count(letter)

def reward_short(completions, **kwargs):
    return [-len(completion[-1]["content"]) / 8 for completion in completions]

args = GRPOConfig(
    output_dir="agent", num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
    learning_rate=1e-3, max_steps=MAX_STEPS, save_steps=1, logging_steps=1, report_to="none",
    disable_tqdm=True,
)
trainer = GRPOTrainer(
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
    reward_funcs=reward_short,
    args=args,
    train_dataset=load_dataset("trl-lib/letters", split="train"),
    tools=[count_letter],
)
result = trainer.train(resume_from_checkpoint=RESUME)
'''
HUB_MODELS = ("Qwen/Qwen2-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
DATASETS = {
    "trl-lib/tldr": [{"prompt": "SUBREDDIT: r/cats\nPOST: my cat sleeps all day.\nTL;DR:"}],
    "trl-lib/letters": [{"prompt": [{"role": "user", "content": "How many r are in strawberry?"}]}],
}


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """``load_dataset`` of ``DATASETS``' names, the hub models as tiny random Llamas (the Qwen one
    without a chat template, SmolLM2's with ChatML), and the working directory a fresh folder."""
    import datasets

    from forge_lightning.models import loading

    def load_dataset(name, split=None, **kwargs):
        assert split == "train"
        return datasets.Dataset.from_list(DATASETS[name])

    hub = loading._load_hub

    def load_hub(spec, dtype):
        if spec == HUB_MODELS[0]:
            tokenizer = make_tokenizer()  # a context as long as a real model's: no prompt is cut
            return make_model(len(tokenizer), max_position_embeddings=2048), tokenizer
        if spec == HUB_MODELS[1]:
            policy = tiny_policy()
            return policy.model, policy.tokenizer
        return hub(spec, dtype)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(loading, "_load_hub", load_hub)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_script(text: str, **values) -> dict:
    """``text`` with TRL's import line changed and ``values`` written in, run as a script."""
    script = text.replace("from trl import", "from forge_lightning.trl import")
    assert script.count("forge_lightning.trl") == 1
    for name, value in values.items():
        script = script.replace(name, repr(value))
    ran = {"__name__": "__main__"}
    exec(compile(script, "train_grpo.py", "exec"), ran)
    return ran


@pytest.mark.integration
def test_trls_quickstart_runs_with_its_import_changed_and_trls_defaults(offline_hub):
    trainer = run_script(QUICKSTART)["trainer"]
    # TRL's defaults: 8 completions per device and step, one prompt's group, for 3 epochs.
    assert trainer.state.global_step == trainer.trainer.global_step == 3
    settings = trainer.module.hparams
    assert (settings.group_size, settings.kl_beta, settings.loss_type) == (8, 0.0, "dapo")
    assert (settings.learning_rate, settings.temperature, settings.max_new_tokens) == (1e-6, 1.0, 512)
    assert (settings.lr_schedule, settings.gradient_checkpointing) == ("linear", True)
    assert "reward" not in settings  # reward_len is the script's own: kept by value
    run = offline_hub / "Qwen2-0.5B-GRPO"
    assert (run / "final" / "config.json").is_file()
    assert (run / "checkpoints" / "last.ckpt").is_file()  # transformers saves at the last step too
    assert not any(p.name.isdigit() for p in run.iterdir())  # no step folder before save_steps 500


@pytest.mark.integration
def test_a_scripts_own_tool_is_taken_and_found_again_when_the_script_resumes(offline_hub):
    first = run_script(AGENT_SCRIPT, MAX_STEPS=1, RESUME=None)
    assert first["result"].global_step == 1
    assert first["trainer"].module.hparams.tools == ["forge_lightning.trl.script.count_letter"]
    # The script run again (a new process would define its functions anew) resumes at step 1.
    with pytest.warns(UserWarning, match="sized for this run's 2 steps"):  # a longer run than the first
        again = run_script(AGENT_SCRIPT, MAX_STEPS=2, RESUME=True)
    assert again["result"].global_step == 2
    assert again["trainer"].module.tools.functions[0].__wrapped__ is again["count_letter"]
    # TRL's state comes back with the checkpoint: the first run's log line, then the new one.
    assert [entry["step"] for entry in again["trainer"].state.log_history] == [1, 2]
