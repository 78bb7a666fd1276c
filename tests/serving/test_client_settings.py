"""The module's wiring of rollout servers (settings/assembly.py): ``rollout_servers`` picks the
remote sources, and what async rollouts on servers cannot do yet is refused by name when the
module is built, before any server starts."""

from __future__ import annotations

import pytest

from forge_lightning.serving.client import RemoteEngine
from forge_lightning.serving.remote_sources import RemoteAsyncRollouts, RemoteSyncRollouts


@pytest.mark.parametrize("mode, kind", [("sync", RemoteSyncRollouts), ("async", RemoteAsyncRollouts)])
def test_rollout_servers_make_the_module_sample_with_a_remote_engine(module, mode, kind):
    grpo = module(rollout_servers=["local:2"], rollout_mode=mode, max_staleness=2)
    assert isinstance(grpo.rollout_source, kind) and isinstance(grpo.engine, RemoteEngine)
    assert grpo.engine.lag == (2 if mode == "async" else 0) and grpo.rollout_source.runs_a_worker
    assert not grpo.engine.running  # nothing starts before the fit
    assert grpo.engine.placement.config.threads == 1


def test_without_rollout_servers_the_engine_in_this_process_samples(module):
    assert not isinstance(module(rollout_servers=[]).rollout_source, RemoteSyncRollouts)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"loss_type": "forge"}, "cannot take loss_type='forge': .*which loss_type='forge' does not take"),
        ({"dynamic_sampling": True}, "a batch's step is known only from the rewards"),
    ],
)
def test_async_on_servers_refuses_what_it_cannot_do_yet(module, settings, message):
    with pytest.raises(ValueError, match=message):
        module(rollout_servers=["local:1"], rollout_mode="async", temperature=0.9, **settings)


def test_async_on_servers_runs_the_calculators_loop_in_this_process(module):
    grpo = module(rollout_servers=["local:1"], rollout_mode="async", calculator="plain")
    grpo.configure_model()  # the rollout source prepared: nothing starts before the fit
    assert grpo.engine.episodes is not None and not grpo.engine.running  # remote_episodes.py
