"""The example Slurm job (configs/slurm/rollout_servers.sbatch), read as Slurm and the package
read it: a heterogeneous job of two components, trainers under ``srun`` as Lightning's SLURM
environment needs them, servers running ``forge-lightning serve`` with flags serve takes, and
the rollout_servers entries it builds in the form the setting reads."""

from __future__ import annotations

import inspect
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import lightning.pytorch as pl
import pytest

from forge_lightning.cli.serve import arguments
from forge_lightning.serving.placement import valid_entries
from forge_lightning.settings.groups import setting_help

SCRIPT = Path(__file__).resolve().parents[2] / "configs" / "slurm" / "rollout_servers.sbatch"


def components() -> list[dict[str, str]]:
    """Each component's ``#SBATCH --name=value`` options, split at ``#SBATCH hetjob``; the first
    holds the job's own options too."""
    parts: list[dict[str, str]] = [{}]
    for line in SCRIPT.read_text().splitlines():
        if not line.startswith("#SBATCH"):
            continue
        option = line.removeprefix("#SBATCH").strip()
        if option == "hetjob":
            parts.append({})
            continue
        name, _, value = option.removeprefix("--").partition("=")
        parts[-1][name] = value
    return parts


def commands() -> list[list[str]]:
    """The script's commands as shell words, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", SCRIPT.read_text())
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [shlex.split(line, comments=True) for line in lines]


def srun(group: int) -> list[str]:
    (found,) = [c for c in commands() if c[:1] == ["srun"] and f"--het-group={group}" in c]
    return found


def variable(name: str) -> str:
    (value,) = re.findall(rf"^{name}=(\S+)", SCRIPT.read_text(), flags=re.M)
    return value


def test_the_job_has_a_trainer_component_and_a_server_component_each_with_its_gpus():
    trainers, servers = components()
    assert trainers["job-name"] and trainers["time"]
    for part in (trainers, servers):
        assert {"nodes", "ntasks-per-node", "gpus-per-node"} <= set(part)
        # One task per GPU: a trainer rank, or a server.
        assert part["ntasks-per-node"] == part["gpus-per-node"]
    assert variable("TRAINER_TASKS_PER_NODE") == trainers["ntasks-per-node"]
    assert variable("SERVERS_PER_NODE") == servers["ntasks-per-node"]


def test_the_trainers_run_under_srun_as_lightnings_slurm_environment_needs():
    command = srun(0)
    fit = command[command.index("forge-lightning") :]
    assert fit[:2] == ["forge-lightning", "fit"]
    flags = dict(
        flag.removeprefix("--").split("=", 1) for flag in fit[2:] if flag.startswith("--") and "=" in flag
    )
    # Lightning's SLURM environment: devices per node = the tasks per node srun starts.
    assert flags["trainer.devices"] == "$TRAINER_TASKS_PER_NODE" and flags["trainer.strategy"] == "ddp"
    trainer_options = inspect.signature(pl.Trainer.__init__).parameters
    assert all(name.split(".", 1)[1] in trainer_options for name in flags if name.startswith("trainer."))
    assert flags["model.rollout_servers"] == "$ROLLOUT_SERVERS" and "rollout_servers" in setting_help()


def test_the_servers_run_forge_lightning_serve_with_flags_it_takes():
    command = srun(1)
    # What bash fills in: the config ($1), the port of local task 0 ($2 + 0), its GPU.
    filled = {"$(($2 + SLURM_LOCALID))": "8100", '"$1"': "run.yaml", "$SLURM_LOCALID": "0"}
    script = command[command.index("-c") + 1]
    for shell, value in filled.items():
        script = script.replace(shell, value)
    inner = shlex.split(script)
    assert inner[:3] == ["exec", "forge-lightning", "serve"]
    args, rest = arguments().parse_known_args(inner[3:])
    assert rest == [] and args.port == 8100 and args.host == "0.0.0.0" and args.config == ["run.yaml"]


def test_the_entries_it_builds_are_what_rollout_servers_reads():
    port, per_node = (
        int(variable("SERVE_PORT").strip("${}").split(":-")[1]),
        int(variable("SERVERS_PER_NODE")),
    )
    entries = [f"gpu-node-{n}:{port + i}" for n in (7, 8) for i in range(per_node)]
    assert valid_entries(entries)


@pytest.mark.integration
def test_the_script_is_valid_bash():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash on this machine")
    done = subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
