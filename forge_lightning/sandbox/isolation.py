"""What the machine gives the sandbox (sandbox/pool.py), found once per process: the namespaces
``unshare`` makes, Landlock, the socket filter (sandbox/seccomp.py), and the bound on a worker's
processes (``RLIMIT_NPROC`` for a user that is not root; root ignores it, so under root a ``pids``
cgroup per worker, v1 or v2). A machine without one of them is refused with the reason, never
given a weaker sandbox.

Who user code runs as: under a trainer that is not root, as that user (its one id, mapped to root
in the worker's user namespace, is all the namespace may hold). Under root, the trainer writes the
worker's user namespace's maps itself (:func:`map_ids`): root and :data:`UNPRIVILEGED` (nobody),
each to itself. The worker, root there and keeping its capabilities (``unshare --keep-caps``),
imports the user's modules; each call's process then drops to nobody (:func:`enter_call`), which
cannot read a root-only file, signal or trace the worker, or open its descriptors."""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from forge_lightning.sandbox import seccomp
from forge_lightning.sandbox.landlock import abi_version

log = logging.getLogger("forge_lightning.sandbox.pool")

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


# The namespaces under a root trainer: the same, with no map of unshare's (the trainer writes it).
ROOT_NAMESPACES = ["--user", "--keep-caps", *NAMESPACES[2:]]
# The host's unprivileged user (nobody), whom a call's process becomes under a root trainer.
UNPRIVILEGED = 65534


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
    why = seccomp.supported()
    if why is not None:
        raise SandboxUnavailable(f"sandbox: process needs a socket filter: {why}")
    drop_to = UNPRIVILEGED if os.geteuid() == 0 else None
    parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    program = (
        f"import sys; sys.path.insert(0, {parent!r}); "
        f"from forge_lightning.sandbox.isolation import check_inside; check_inside({drop_to!r})"
    )
    try:
        done = started(
            [sys.executable, "-I", "-S", "-c", program],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        err = done.communicate(timeout=60)[1]
    except (OSError, subprocess.TimeoutExpired) as error:
        err, failed = repr(error), True
    else:
        failed = done.returncode != 0
    if failed:
        raise SandboxUnavailable(
            "sandbox: process needs user, pid, network and mount namespaces (unshare "
            f"{' '.join(namespaces())}), a seccomp filter and, under root, a call's process as nobody "
            f"reaching Python; here: {(err or 'it failed').strip()[-500:]}"
        )
    who = "nobody" if os.geteuid() == 0 else "the trainer's own user"
    _probed.append(
        f"namespaces (user, pid, net, mount, ipc), Landlock ABI {abi}, a socket filter, rlimits and "
        f"{limit}; calls run as {who}"
    )
    return _probed[0]


def check_inside(drop_to: int | None) -> None:
    """The probe's program (:func:`probe`), the first process of a worker's namespaces: what a
    worker does to itself before its first task (it waits for its user map, puts Python back for
    ``drop_to``, installs the socket filter), checked; then a call's process, as ``drop_to``,
    starts an interpreter. Exits with a message where one fails."""
    import socket

    mapped()
    if os.getpid() != 1:
        sys.exit(f"the worker is not the first process of its pid namespace (pid {os.getpid()})")
    if drop_to is not None:
        expose(python_installation(), drop_to)
    seccomp.deny_sockets()
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
    except PermissionError:
        pass
    else:
        sys.exit("a socket was made under the socket filter")
    left, right = socket.socketpair()
    left.send(b"x")
    if right.recv(1) != b"x":
        sys.exit("a socket pair does not work under the socket filter")
    pid = os.fork()
    if pid == 0:
        try:
            enter_call(2, drop_to)
            subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
        except BaseException as err:
            print(f"a call's process (as {drop_to}) could not start Python: {err!r}", file=sys.stderr)
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        sys.exit(1)


def python_installation() -> list[str]:
    """The folders of Python's installation: its prefixes, the interpreter's folder, its
    site-packages (the user's too) and this package's own folder (an editable install imports it
    through a finder, from a folder that need not be on ``sys.path``)."""
    import site

    executable = os.path.realpath(sys.executable)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # forge_lightning/
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(executable), package}
    paths.update(site.getsitepackages())
    paths.add(site.getusersitepackages())
    return sorted(os.path.realpath(path) for path in paths)


def namespaces() -> list[str]:
    """``unshare``'s options for a worker: under root without a map (:func:`map_ids` writes it)."""
    return ROOT_NAMESPACES if os.geteuid() == 0 else NAMESPACES


def started(command: list[str], cgroup: str | None = None, **popen: Any) -> subprocess.Popen:
    """``command`` started by ``unshare`` in a worker's namespaces (in ``cgroup``, where given,
    before anything else runs), in a session of its own; under root, the user namespace's maps
    are written before this returns. OSError where they cannot be."""
    command = ["unshare", *namespaces(), *command]
    if cgroup is not None:  # join the cgroup before anything else runs
        command = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(cgroup, "cgroup.procs"), *command]
    process = subprocess.Popen(command, start_new_session=True, **popen)
    if os.geteuid() == 0:
        try:
            map_ids(process.pid)
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    return process


def map_ids(pid: int, wait: float = 10.0) -> None:
    """Once ``pid`` (``unshare``) is in a user namespace of its own, map root and
    :data:`UNPRIVILEGED` there, each to itself. The worker waits for it (:func:`mapped`)."""
    mine, deadline = os.readlink("/proc/self/ns/user"), time.monotonic() + wait
    while os.readlink(f"/proc/{pid}/ns/user") == mine:  # FileNotFoundError: it died
        if time.monotonic() > deadline:
            raise OSError(f"the sandbox's unshare (pid {pid}) made no user namespace in {wait:g}s")
        time.sleep(0.0005)
    lines = f"0 0 1\n{UNPRIVILEGED} {UNPRIVILEGED} 1\n"
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(lines)


def mapped(wait: float = 10.0) -> None:
    """In the worker: wait until this user namespace's map is written (where nothing writes it,
    as under a trainer that is not root, it is written by unshare before the worker starts)."""
    deadline = time.monotonic() + wait
    while not open("/proc/self/uid_map").read().strip():
        if time.monotonic() > deadline:
            raise OSError(f"no user map was written in {wait:g}s")
        time.sleep(0.0005)


def enter_call(keep: int, drop_to: int | None) -> None:
    """In a process forked by the worker to run user code: close every descriptor but the
    standard ones and ``keep`` (its own answer pipe), and become ``drop_to`` (None: stay)."""
    os.closerange(3, keep)
    os.closerange(keep + 1, max(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 16))
    if drop_to is not None:
        os.setgroups([])
        os.setresgid(drop_to, drop_to, drop_to)
        os.setresuid(drop_to, drop_to, drop_to)


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


# mount(2) flags, and open_tree(2)/move_mount(2) (Linux 5.2+, the same numbers on every architecture).
_MS_NOSUID, _MS_NODEV = 2, 4
_OPEN_TREE, _MOVE_MOUNT = 428, 429
_AT_FDCWD, _OPEN_TREE_CLONE, _AT_RECURSIVE, _MOVE_MOUNT_F_EMPTY_PATH = -100, 1, 0x8000, 4


def expose(paths: list[str], user: int) -> None:
    """In the worker, before Landlock (which forbids mounts): where a folder above one of ``paths``
    is closed to ``user`` (a Python installed below ``/root``, mode 0700), hide that folder under an
    empty one of this mount namespace's own and put back ``paths`` alone below it, so that a call
    running as ``user`` reaches them and nothing else there. OSError where the kernel refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    closed: dict[str, list[str]] = {}
    for path in paths:
        folder = _closed_above(path, user)
        if folder is not None and os.path.exists(path):
            closed.setdefault(folder, []).append(path)
    for folder, inside in closed.items():
        trees = []
        for path in inside:  # a detached copy of each, taken before the folder is hidden
            fd = libc.syscall(
                _OPEN_TREE, _AT_FDCWD, path.encode(), _OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC
            )
            if fd < 0:
                raise OSError(ctypes.get_errno(), f"open_tree({path}) failed")
            trees.append((path, fd))
        if (
            libc.mount(b"tmpfs", folder.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0755,size=64k")
            != 0
        ):
            raise OSError(ctypes.get_errno(), f"mounting an empty folder on {folder} failed")
        for path, fd in trees:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                open(path, "a").close()
            moved = libc.syscall(_MOVE_MOUNT, fd, b"", _AT_FDCWD, path.encode(), _MOVE_MOUNT_F_EMPTY_PATH)
            os.close(fd)
            if moved != 0:
                raise OSError(ctypes.get_errno(), f"putting {path} back failed")


def _closed_above(path: str, user: int) -> str | None:
    """The highest folder above ``path`` that ``user`` (in no group of the folder's) cannot pass."""
    parts = os.path.realpath(path).split(os.sep)[1:]
    for depth in range(1, len(parts)):
        folder = os.sep + os.path.join(*parts[:depth])
        info = os.stat(folder)
        passes = 0o001 if info.st_uid != user else 0o100
        if not info.st_mode & passes:
            return folder
    return None
