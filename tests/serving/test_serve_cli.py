"""``forge-lightning serve`` (cli/serve.py): its help, the settings it reads from a run's config,
and (integration) a server process that a trainer in this process pushes weights to."""

from __future__ import annotations

import subprocess
import threading

import pytest
import torch
from helpers.serve_process import start_serve
from helpers.serving import SECRET, call

from forge_lightning.cli.forge_cli import main as forge_main
from forge_lightning.cli.serve import main as serve_main
from forge_lightning.cli.serve import model_settings
from forge_lightning.rollout.engines.base import SamplingParams
from forge_lightning.serving import weights
from forge_lightning.serving.wire import SECRET_ENV, GenerateAnswer, GenerateCall, GroupCall, Info, UpdateCall
from forge_lightning.testing.tiny import tiny_policy

RUN_CONFIG = """\
seed_everything: 3
trainer:
  max_steps: 2
model:
  model: {model}
  model_dtype: float32
  lr: 1.0e-5
data:
  class_path: forge_lightning.data.ArithmeticDataModule
"""


def test_serve_has_its_help_and_is_listed_in_the_top_level_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_main(["--help"])
    assert exit_.value.code == 0
    assert "--port PORT" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        forge_main(["--help"])
    assert "serve --config X --port P" in " ".join(capsys.readouterr().out.split())


def test_the_server_reads_the_model_section_of_a_runs_config_and_its_flags(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(RUN_CONFIG.format(model="random:somewhere"))
    settings = model_settings(
        [str(config)], ["--model.model_dtype", "bfloat16", "--model.reward.init_args.url=x"]
    )
    assert (settings["model"], settings["model_dtype"], settings["attn_implementation"]) == (
        "random:somewhere",
        "bfloat16",
        None,
    )
    with pytest.raises(ValueError, match="model_dtyp: not a setting of the module"):
        model_settings([str(config)], ["--model.model_dtyp", "bfloat16"])
    with pytest.raises(ValueError, match="unrecognized argument --trainer.max_steps: serve takes --config"):
        model_settings([str(config)], ["--trainer.max_steps", "3"])


def start_server(tmp_path, environ: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """``python -m forge_lightning serve`` for a tiny model saved under ``tmp_path``; the process
    and the URL its first line gives."""
    policy = tiny_policy(seed=0, max_position_embeddings=256)
    policy.model.save_pretrained(tmp_path / "model")
    policy.tokenizer.save_pretrained(tmp_path / "model")
    config = tmp_path / "run.yaml"
    config.write_text(RUN_CONFIG.format(model=tmp_path / "model"))
    return start_serve(config, environ[SECRET_ENV], tmp_path / "server.log", timeout_s=60)


@pytest.mark.integration
def test_serve_refuses_to_start_without_the_secret(tmp_path):
    with pytest.raises(AssertionError, match=f"exited 2: forge-lightning serve: {SECRET_ENV} is not set"):
        start_server(tmp_path, {SECRET_ENV: ""})


@pytest.mark.integration
def test_a_server_process_generates_and_takes_weights_from_a_trainer_process(tmp_path):
    process, url = start_server(tmp_path, {SECRET_ENV: SECRET})
    try:
        assert call(url, "/health", secret="wrong")[0] == 401
        info = Info.from_json(call(url, "/info")[1])
        trainer = tiny_policy(seed=4, max_position_embeddings=256).model
        store = weights.open_store("127.0.0.1", 0, master=True, timeout_s=30)
        joined = threading.Thread(
            target=call, args=(url, "/weights/group", GroupCall("127.0.0.1", store.port, "a", 30).to_json())
        )
        joined.start()
        group = weights.open_group("127.0.0.1", store.port, "a", weights.TRAINER_RANK, 30, store=store)
        joined.join()
        answer = {}
        updating = threading.Thread(
            target=lambda: answer.update(update=call(url, "/weights/update", UpdateCall(1).to_json()))
        )
        updating.start()
        weights.WeightSender(group, info.parameters).send(trainer.named_parameters())
        updating.join()
        assert answer["update"] == (200, {"version": 1})

        request = GenerateCall("r", [[5, 6, 7]], 1, SamplingParams(6, greedy=True), logprobs=True)
        served = GenerateAnswer.from_json(call(url, "/generate", request.to_json())[1])
        with torch.no_grad():  # the server's greedy tokens are the trainer's weights' own
            expected = trainer.generate(
                torch.tensor([[5, 6, 7]]), do_sample=False, max_new_tokens=6, eos_token_id=1, pad_token_id=0
            )[0, 3:]
        assert served.completions[0] == expected.tolist()[: len(served.completions[0])]
        assert served.versions[0] == [1] * len(served.completions[0])
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
