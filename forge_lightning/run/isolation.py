"""What the machine gives the sandbox (run/sandbox.py), found once per process: the namespaces
``unshare`` makes, Landlock, and the bound on a worker's processes (``RLIMIT_NPROC`` for a user
that is not root; root ignores it, so under root a ``pids`` cgroup per worker, v1 or v2). A machine
without one of them is refused with the reason, never given a weaker sandbox."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

from forge_lightning.run.landlock import abi_version

log = logging.getLogger("forge_lightning.run.sandbox")

# The namespaces of a worker: its own user (root in it, for the mounts), pid (it is the first
# process: all die with it), network (none), mount (its own /proc) and IPC.
NAMESPACES = [
    "--user",
    "--map-root-user",
    "--net",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount-proc",
    "--ipc",
]


class SandboxUnavailable(RuntimeError):
    """This machine cannot give the sandbox's isolation; the message says what is missing."""


_probed: list[str] = []  # the mechanism, once found
_PIDS_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1's pids hierarchy, v2's


def probe() -> str:
    """The mechanism this machine gives the sandbox (a sentence), found once per process by
    starting one sandboxed interpreter; SandboxUnavailable with the reason when something is missing."""
    if _probed:
        return _probed[0]
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(
            f"sandbox: process needs Linux (namespaces, Landlock); this is {sys.platform}"
        )
    if shutil.which("unshare") is None:
        raise SandboxUnavailable(
            "sandbox: process needs the unshare command (util-linux), which is not on PATH"
        )
    abi = abi_version()
    if abi < 1:
        raise SandboxUnavailable(
            "sandbox: process needs Landlock (Linux 5.13+, enabled in the kernel's lsm= list); "
            "this kernel has none"
        )
    limit = "RLIMIT_NPROC"
    if os.geteuid() == 0:  # root ignores RLIMIT_NPROC: the process bound needs a pids cgroup
        try:
            remove_cgroup(pids_cgroup(8))
        except OSError as err:
            raise SandboxUnavailable(
                f"sandbox: process runs as root here, which RLIMIT_NPROC does not bind, and no pids "
                f"cgroup can be made to bound its processes instead ({err})"
            ) from err
        limit = "a pids cgroup"
    check = [sys.executable, "-I", "-S", "-c", "import os; assert os.getpid() == 1"]
    done = subprocess.run(["unshare", *NAMESPACES, *check], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise SandboxUnavailable(
            "sandbox: process needs user, pid, network and mount namespaces (unshare "
            f"{' '.join(NAMESPACES)}), which failed here: {done.stderr.strip()[-500:]}"
        )
    _probed.append(f"namespaces (user, pid, net, mount, ipc), Landlock ABI {abi}, rlimits and {limit}")
    return _probed[0]


def pids_root() -> str:
    """This process's folder in the pids cgroup hierarchy (v1, else v2)."""
    for line in open("/proc/self/cgroup").read().splitlines():
        number, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return os.path.join(_PIDS_ROOTS[0], path.lstrip("/"))
        if number == "0" and os.path.exists(os.path.join(_PIDS_ROOTS[1], "cgroup.controllers")):
            return os.path.join(_PIDS_ROOTS[1], path.lstrip("/"))
    raise OSError("no pids cgroup controller is mounted")


def pids_cgroup(processes: int) -> str:
    """A new pids cgroup below this process's, holding at most ``processes`` tasks."""
    folder = tempfile.mkdtemp(prefix=f"forge-sandbox-{os.getpid()}-", dir=pids_root())
    try:  # cgroup v2 gives a child the pids controller only where its parent's subtree enables it
        with open(os.path.join(folder, "pids.max"), "w") as f:
            f.write(str(processes))
    except OSError:
        os.rmdir(folder)
        raise
    return folder


def remove_cgroup(folder: str | None, wait: float = 2.0) -> None:
    """Remove an emptied cgroup (its last processes may still be dying: retried for ``wait`` s)."""
    if folder is None:
        return
    deadline = time.monotonic() + wait
    while True:
        try:
            os.rmdir(folder)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                log.warning("sandbox: the cgroup %s could not be removed", folder)
                return
            time.sleep(0.01)
