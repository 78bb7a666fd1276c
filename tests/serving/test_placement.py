"""Where rollout servers run (serving/placement.py): the ``rollout_servers`` entries, the secret each
kind of server gets, and the command and config a started server runs with."""

from __future__ import annotations

import json

import pytest

from forge_lightning.serving.placement import Entry, Placement, parse_entry, served_model, valid_entries
from forge_lightning.serving.processes import ServeConfig, serve_command
from forge_lightning.serving.wire import SECRET_ENV
from forge_lightning.settings.checks import validate_hparams


@pytest.mark.parametrize(
    "text, entry",
    [
        ("local:2", Entry("local", 2)),
        ("ray:3", Entry("ray", 3)),
        ("node7:8000", Entry("remote", 1, "node7:8000")),
        ("10.0.0.5:31337", Entry("remote", 1, "10.0.0.5:31337")),
        ("[::1]:9000", Entry("remote", 1, "[::1]:9000")),
    ],
)
def test_each_kind_of_entry_is_read(text, entry):
    assert parse_entry(text) == entry


@pytest.mark.parametrize(
    "text, message",
    [
        ("local:0", "starts at least 1 server"),
        ("node7", "is not local:N, ray:N or host:port"),
        ("node7:99999", "the port must be in 1..65535"),
        ("local:two", "is not local:N, ray:N or host:port"),
    ],
)
def test_a_wrong_entry_is_refused_saying_what_an_entry_looks_like(text, message):
    with pytest.raises(ValueError, match=message):
        parse_entry(text)
    assert not valid_entries([text])


def test_the_setting_takes_entries_and_refuses_others_by_name():
    validate_hparams({"rollout_servers": ["local:1", "node7:8000"], "partial_rollouts": True})
    with pytest.raises(ValueError, match="rollout_servers"):
        validate_hparams({"rollout_servers": ["local"]})


def test_servers_you_started_need_their_secret_and_started_ones_get_a_fresh_one(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=f"set {SECRET_ENV} to the secret they were started with"):
        Placement(["node7:8000"], ServeConfig({}))
    first, second = Placement(["local:1"], ServeConfig({})), Placement(["local:1"], ServeConfig({}))
    assert len(first.secret) >= 32 and first.secret != second.secret
    monkeypatch.setenv(SECRET_ENV, "given")
    assert Placement(["node7:8000", "local:1"], ServeConfig({})).secret == "given"


def test_servers_you_started_are_reached_where_they_are_and_nothing_is_started(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "given")
    placement = Placement(["node7:8000", "node8:8000"], ServeConfig({}))
    assert placement.start(model=None, tokenizer=None) == [
        ("node7:8000", "node7:8000"),
        ("node8:8000", "node8:8000"),
    ]
    assert placement.processes == []


def test_a_started_server_runs_the_package_serve_command_with_the_trainers_model_settings(tmp_path):
    config = ServeConfig({"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "model_dtype": "bfloat16"}).write(
        tmp_path
    )
    assert json.loads(config.read_text()) == {
        "model": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "model_dtype": "bfloat16"}
    }
    command = serve_command(config, 4321)
    assert command[1:] == [
        "-m",
        "forge_lightning",
        "serve",
        "--config",
        str(config),
        "--port",
        "4321",
        "--host",
        "127.0.0.1",
    ]


def test_a_model_given_as_an_object_is_saved_for_the_servers_once(tmp_path, tiny_model, tokenizer):
    assert served_model(tiny_model, tokenizer, "embedded", tmp_path) == "embedded"
    folder = served_model(tiny_model, tokenizer, None, tmp_path)
    assert (tmp_path / "model" / "config.json").is_file() and folder == str(tmp_path / "model")
    stamp = (tmp_path / "model" / "config.json").stat().st_mtime_ns
    served_model(tiny_model, tokenizer, None, tmp_path)
    assert (tmp_path / "model" / "config.json").stat().st_mtime_ns == stamp
