"""Running as the configured unprivileged user: a runner started as root switches its own
user, group and supplementary groups for good (real, effective and saved IDs) and sets
no-new-privileges before it does anything else; one started as another user must already be
that user. Either way neither the runner nor the job ever runs as root."""

from __future__ import annotations

import contextlib
import ctypes
import grp
import os
import pwd
from dataclasses import dataclass

from s4format.errors import S4Error

PR_SET_NO_NEW_PRIVS = 38


class PrivilegeError(S4Error):
    """The runner cannot run as the configured unprivileged user."""


@dataclass(frozen=True)
class Identity:
    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def lookup(user: str) -> Identity:
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise PrivilegeError(f"user {user!r} does not exist: create it (the image's "
                             "s4-runner user) or fix 'user' in the config") from None
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise PrivilegeError(f"user {user!r} has uid or gid 0: the job must not run as root")
    groups = tuple(g for g in os.getgrouplist(user, pw.pw_gid) if g != 0)
    return Identity(user, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir)


def become(user: str) -> Identity:
    """Switch this process to ``user`` if it is root; check it already is that user if not."""
    who = lookup(user)
    if os.geteuid() == 0 or os.getuid() == 0:
        try:
            os.setgroups(list(who.groups))
            os.setresgid(who.gid, who.gid, who.gid)
            os.setresuid(who.uid, who.uid, who.uid)
        except OSError as exc:
            raise PrivilegeError(f"cannot switch to user {user!r}: {exc}") from None
    _no_new_privileges()
    uids, gids = os.getresuid(), os.getresgid()
    if set(uids) != {who.uid} or set(gids) != {who.gid}:
        raise PrivilegeError(f"the runner runs as {_name(os.geteuid())!r} but the config "
                             f"names user {user!r}: start it as root or as that user")
    with contextlib.suppress(PermissionError):
        os.setuid(0)  # must fail: a drop that could be undone is no drop
        raise PrivilegeError("root privileges could be regained after the switch")
    if 0 in os.getgroups():
        raise PrivilegeError(f"user {user!r} is in group root")
    return who


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _no_new_privileges() -> None:
    """Neither the runner nor anything it starts can gain privileges (setuid binaries)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def group_names(gids: tuple[int, ...]) -> list[str]:
    out = []
    for g in gids:
        try:
            out.append(grp.getgrgid(g).gr_name)
        except KeyError:
            out.append(str(g))
    return out
