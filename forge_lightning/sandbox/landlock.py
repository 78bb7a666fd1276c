"""Landlock (Linux 5.13+), through its three system calls: a process restricts itself, and every
process it starts after, to reading the paths it names and writing below the ones it names; TCP
binds and connects are refused where the kernel's Landlock has network rules (ABI 4), and signals
to processes outside the domain where it has scopes (ABI 6). No privilege is needed, and a
restriction cannot be undone, only narrowed further.

The sandbox (sandbox/pool.py) probes :func:`abi_version` once at its start and refuses to run
without Landlock; its worker calls :func:`restrict` before it reads any task.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

# The system calls' numbers: the same on every architecture since they were added (5.13).
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# Filesystem rights, by the ABI version that added them.
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_V1 = (1 << 13) - 1  # execute .. make_sym
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV  # all a file may hold
_NET_TCP = (1 << 0) | (1 << 1)  # bind, connect (ABI 4)
_SCOPES = (1 << 0) | (1 << 1)  # abstract unix sockets, signals (ABI 6)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (not built in, or not enabled)."""
    version = _libc().syscall(
        _CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)
    )
    return max(int(version), 0)


def _handled_fs(abi: int) -> int:
    return (
        _FS_V1
        | (_REFER if abi >= 2 else 0)
        | (_TRUNCATE if abi >= 3 else 0)
        | (_IOCTL_DEV if abi >= 5 else 0)
    )


def restrict(
    read: Iterable[str],
    write: Iterable[str],
    read_write_files: Iterable[str] = (),
    list_only: Iterable[str] = (),
) -> int:
    """Restrict this process (and what it starts) to reading and executing below ``read``, doing
    anything below ``write``, reading and writing the files ``read_write_files`` (``/dev/null``)
    and listing the folders below ``list_only`` (their names, not their files' contents); no TCP,
    no signals out of the domain where the kernel can refuse them. Paths that do not exist are
    skipped. Returns the ABI version used; OSError naming the call that failed."""
    libc, abi = _libc(), abi_version()
    if abi < 1:
        raise OSError("Landlock is not available in this kernel")
    handled = _handled_fs(abi)
    attr = _RulesetAttr(handled, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        rights = [(p, _EXECUTE | _READ_FILE | _READ_DIR) for p in read]
        rights += [(p, handled) for p in write]
        rights += [(p, _READ_FILE | _WRITE_FILE) for p in read_write_files]
        rights += [(p, _READ_DIR) for p in list_only]
        for path, allowed in rights:
            _add_rule(libc, ruleset, path, allowed & handled)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return abi


def _add_rule(libc: ctypes.CDLL, ruleset: int, path: str, allowed: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a path that is not there needs no rule
    try:
        if not os.path.isdir(path):
            allowed &= _FILE_RIGHTS
        if not allowed:
            return  # a folder's right given to a file
        rule = _PathBeneath(allowed, fd)
        if libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
    finally:
        os.close(fd)
