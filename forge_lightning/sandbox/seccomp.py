"""No sockets for sandboxed code: a seccomp filter, installed through ``prctl`` with no dependency,
under which ``socket``, ``connect``, ``bind``, ``listen``, ``sendmsg``, ``sendmmsg`` and a
``sendto`` that names an address fail with EPERM (Python's catchable PermissionError), as do
``io_uring``'s three calls (its requests would connect without a system call of their own). A
filter is inherited by every process started after it and cannot be removed.

``socketpair`` is not filtered: a connected pair within the process is how asyncio wakes its loop,
and what ``multiprocessing.Pipe`` gives, so ``async def`` rewards and the sandbox's own pipes work
as before; a ``send`` on such a pair names no address and passes. Landlock (sandbox/landlock.py) scopes
abstract Unix sockets and, from ABI 4, TCP, but not a pathname Unix socket: this filter closes that.

The sandbox (sandbox/isolation.py) probes it once in a fresh interpreter; its worker
(sandbox/worker.py) calls :func:`deny_sockets` before it reads any task.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import sys

_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_LD_ABS_W, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
# struct seccomp_data: the call's number, the audit architecture, the instruction pointer, the arguments.
_NR, _ARCH, _ARGS = 0, 4, 16
_X32_BIT = 0x40000000  # x86-64's x32 calls carry x86-64's architecture: refused whole

# By machine: the audit architecture, the filtered calls' numbers and sendto's.
_MACHINES = {
    "x86_64": (0xC000003E, {"socket": 41, "connect": 42, "sendmsg": 46, "bind": 49, "listen": 50,
                            "sendmmsg": 307, "io_uring_setup": 425, "io_uring_enter": 426,
                            "io_uring_register": 427}, 44),
    "aarch64": (0xC00000B7, {"socket": 198, "bind": 200, "listen": 201, "connect": 203, "sendmsg": 211,
                             "sendmmsg": 269, "io_uring_setup": 425, "io_uring_enter": 426,
                             "io_uring_register": 427}, 206),
}  # fmt: skip


class _Instruction(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Instruction))]


def supported() -> str | None:
    """Why this machine cannot have the filter (a sentence), or None where it can."""
    if not sys.platform.startswith("linux"):
        return f"the socket filter needs Linux's seccomp; this is {sys.platform}"
    if platform.machine() not in _MACHINES:
        return f"the socket filter knows the system calls of {', '.join(_MACHINES)}, not {platform.machine()}"
    return None


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter for ``machine`` as BPF instructions ``(code, jump if true, jump if false, k)``:
    another architecture's call kills the process, a filtered call fails with EPERM, anything else
    runs."""
    arch, numbers, sendto = _MACHINES[machine]
    low, high = _ARGS + 8 * 4, _ARGS + 8 * 4 + 4  # sendto's dest_addr, a 64-bit little-endian pointer
    # (code, k, where to go if true, if false): a label, or None for the next instruction.
    lines: list[tuple[str | None, int, int, str | None, str | None]] = [
        (None, _LD_ABS_W, _ARCH, None, None),
        (None, _JEQ_K, arch, None, "kill"),
        (None, _LD_ABS_W, _NR, None, None),
    ]
    if machine == "x86_64":
        lines.append((None, _JGE_K, _X32_BIT, "deny", None))
    lines += [(None, _JEQ_K, number, "deny", None) for number in numbers.values()]
    lines += [
        (None, _JEQ_K, sendto, None, "allow"),
        (None, _LD_ABS_W, low, None, None),
        (None, _JEQ_K, 0, None, "deny"),
        (None, _LD_ABS_W, high, None, None),
        (None, _JEQ_K, 0, "allow", "deny"),
        ("allow", _RET_K, _RET_ALLOW, None, None),
        ("deny", _RET_K, _RET_ERRNO | errno.EPERM, None, None),
        ("kill", _RET_K, _RET_KILL_PROCESS, None, None),
    ]
    where = {label: index for index, (label, *_) in enumerate(lines) if label}

    def jump(index: int, target: str | None) -> int:
        return 0 if target is None else where[target] - index - 1

    return [(code, jump(i, yes), jump(i, no), k) for i, (_, code, k, yes, no) in enumerate(lines)]


def deny_sockets() -> None:
    """Install the filter on this process (and what it starts from now on); OSError where the
    kernel refuses it. Needs no privilege once ``no_new_privs`` is set (Landlock sets it)."""
    why = supported()
    if why is not None:
        raise OSError(why)
    instructions = program(platform.machine())
    array = (_Instruction * len(instructions))(*(_Instruction(*i) for i in instructions))
    fprog = _Program(len(instructions), array)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: a filter needs it without CAP_SYS_ADMIN
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
