"""What the kernel says of a TCP connection held by another process of this machine, by its socket's inode.

A prefork pool process reads it for the connection its worker's main process holds (``presence.py``),
when that process is frozen or stalled and cannot say itself: a socket the peer closed (``CLOSE_WAIT``) or
reset (gone from the table) is in the kernel's state whatever its holder is doing. Linux only, from
``/proc/net/tcp`` and ``/proc/net/tcp6`` of this network namespace, which a pool process shares with its
main process; elsewhere nothing can be told (``None``).
"""

from __future__ import annotations

import os

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
ESTABLISHED = "01"  # the kernel's TCP_ESTABLISHED, as /proc/net/tcp writes it


def inode(fileno: int) -> int:
    """The inode of the socket ``fileno``: how the tables name it."""
    return os.fstat(fileno).st_ino


def established(ino: int) -> bool | None:
    """Whether the TCP socket ``ino`` is established; ``None`` where the tables cannot be read."""
    needle = f" {ino} ".encode()
    read_any = False
    for table in TABLES:
        try:
            with open(table, "rb") as f:
                data = f.read()
        except OSError:
            continue
        read_any = True
        at = data.find(needle)
        while at != -1:
            start = data.rfind(b"\n", 0, at) + 1
            fields = data[start : data.find(b"\n", at)].split()
            # sl local remote st tx:rx tr:when retrnsmt uid timeout inode ...
            if len(fields) > 9 and fields[9] == str(ino).encode():
                return fields[3].decode() == ESTABLISHED
            at = data.find(needle, at + 1)
    return False if read_any else None


def watchable(fileno: int) -> bool:
    """Whether another process of this namespace can tell the state of socket ``fileno`` (a TCP one,
    established now, on a kernel that lists it)."""
    try:
        return established(inode(fileno)) is True
    except OSError:
        return False
