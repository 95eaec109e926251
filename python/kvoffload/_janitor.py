"""The janitor of a shared region: ``python -m kvoffload._janitor PATH DEV INO``.

``HostPool`` runs this file's source with ``python -I -S -c`` (it needs the standard library only).

The creator of a named region starts one, detached. Every process using the region holds a shared
``flock`` on it, which the kernel drops when the process exits or is killed; the janitor polls for
the exclusive lock and, once it gets it (no holder left), unlinks the name if it still names the
same inode. So the name is removed even when the last process using it was killed.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time

POLL_SECONDS = 0.1


def _same(path: str, dev: int, ino: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def watch(path: str, dev: int, ino: int) -> None:
    """Return once ``path`` is gone, replaced, or unlinked here after its last holder left."""
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                if _same(path, dev, ino):
                    os.unlink(path)
                return
        finally:
            os.close(fd)
        time.sleep(POLL_SECONDS)


def main(argv: list[str]) -> int:
    """Entry point: ``PATH DEV INO``."""
    if len(argv) != 4:
        print("usage: python -m kvoffload._janitor PATH DEV INO", file=sys.stderr)
        return 2
    watch(argv[1], int(argv[2]), int(argv[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
