"""Shared pools under /dev/shm, with real processes: the same bytes seen by both, sizes checked on
attach, a creator's failure or death visible to attachers (no hang), and nothing left in /dev/shm
afterwards, also when processes were killed. Every test checks the last point (``shm_name``)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from _helpers import exit_code, fork
from kvoffload import HostPool, InvalidArgumentError, KVOffloadError, SharedRegionError

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")

# Creates (or attaches), writes chunk 3, then follows commands from stdin.
WORKER = """
import sys
import numpy as np
from kvoffload import HostPool
name, mode = sys.argv[1], sys.argv[2]
pool = HostPool(8, 4096, shared_name=name, shared_mode=mode, register_cuda=False)
view = pool.view()
if pool.stats().creator:
    view[3] = np.arange(4096) % 251
print("ready", pool.stats().creator, int(view[3, 300]), flush=True)
for line in sys.stdin:
    if line.strip() == "read":
        print("seen", int(view[5, 7]), flush=True)
    else:
        break
pool.close()
print("closed", flush=True)
"""

# A creator that publishes the region, stalls, then fails or sets it up (test hook of the core).
STALLING_CREATOR = """
import sys
from kvoffload import _native
from kvoffload.memory import _JANITOR
try:
    _native.HostMemory(
        8, 4096, num_threads=1, lock_pages=False, huge_pages=False, shared_name=sys.argv[1],
        shared_mode="create", janitor=_JANITOR,
        test_creator_stall=(float(sys.argv[2]), sys.argv[3] == "fail"),
    )
except Exception as e:
    print(type(e).__name__, e, flush=True)
"""


def path_of(name: str) -> Path:
    return SHM / f"kvoffload.{name}"


def wait_for(cond: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A fresh region name; after the test its file must be gone (janitors get 10 s)."""
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    assert wait_for(lambda: not path_of(name).exists()), f"{path_of(name)} was left behind"


def holds_lock(pid: int, path: Path) -> bool:
    """Whether process ``pid`` holds an flock on ``path`` (from /proc/locks)."""
    try:
        ino = path.stat().st_ino
        locks = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return False
    for line in locks:
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if (
            len(fields) >= 6
            and fields[1] == "FLOCK"
            and fields[4] == str(pid)
            and fields[5].rsplit(":", 1)[-1] == str(ino)
        ):
            return True
    return False


def spawn(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def ask(proc: subprocess.Popen[str], line: str | None = None) -> str:
    assert proc.stdin is not None
    assert proc.stdout is not None
    if line is not None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    return proc.stdout.readline().strip()


def finish(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def test_two_processes_share_bytes_and_leave_nothing(shm_name: str) -> None:
    creator = spawn(WORKER, shm_name, "create")
    try:
        assert ask(creator) == f"ready True {300 % 251}"
        with HostPool(8, 4096, shared_name=shm_name, shared_mode="attach") as pool:
            stats = pool.stats()
            assert not stats.creator
            assert stats.shared_path == str(path_of(shm_name))
            view = pool.view()
            assert (view[3] == np.arange(4096) % 251).all()  # the creator's bytes
            view[5, 7] = 123
            assert ask(creator, "read") == "seen 123"  # ours, seen by the creator
            assert ask(creator, "quit") == "closed"
            assert creator.wait(timeout=30) == 0
            assert path_of(shm_name).exists()  # we still use it
            assert view[5, 7] == 123
            del view  # a live view would keep the region (and its name) in use
        assert not path_of(shm_name).exists()  # the last user removed it at once
    finally:
        finish(creator)


def test_creator_killed_while_an_attacher_lives(shm_name: str) -> None:
    creator = spawn(WORKER, shm_name, "create")
    try:
        assert ask(creator).startswith("ready True")
        pool = HostPool(8, 4096, shared_name=shm_name, shared_mode="attach")
        os.kill(creator.pid, signal.SIGKILL)
        creator.wait(timeout=30)
        view = pool.view()
        assert view[3, 300] == 300 % 251  # the memory outlives its creator
        view[0] = 1
        pool.close()
        del view
        assert not path_of(shm_name).exists()
    finally:
        finish(creator)


def test_all_users_killed_the_janitor_removes_the_name(shm_name: str) -> None:
    creator = spawn(WORKER, shm_name, "create")
    attacher = None
    try:
        assert ask(creator).startswith("ready True")
        attacher = spawn(WORKER, shm_name, "attach")
        assert ask(attacher) == f"ready False {300 % 251}"
        for proc in (creator, attacher):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        # No process is left to clean up: the creator's janitor does (checked by shm_name).
        assert wait_for(lambda: not path_of(shm_name).exists())
    finally:
        finish(creator)
        if attacher is not None:
            finish(attacher)


def test_a_creators_failure_reaches_the_attacher(shm_name: str) -> None:
    creator = spawn(STALLING_CREATOR, shm_name, "4.0", "fail")
    try:
        assert wait_for(path_of(shm_name).exists)
        with pytest.raises(SharedRegionError, match="injected creator failure"):
            HostPool(8, 4096, shared_name=shm_name, shared_mode="attach")
        assert "injected creator failure" in ask(creator)
    finally:
        finish(creator)


def test_a_creator_killed_during_setup_does_not_hang_the_attacher(shm_name: str) -> None:
    creator = spawn(STALLING_CREATOR, shm_name, "600", "ok")
    errors: list[BaseException] = []

    def attach() -> None:
        try:
            HostPool(8, 4096, shared_name=shm_name, shared_mode="attach")
        except BaseException as e:
            errors.append(e)

    try:
        assert wait_for(path_of(shm_name).exists)
        waiter = threading.Thread(target=attach)
        waiter.start()
        # Kill only once the attacher holds the region and waits (its flock shows in /proc).
        assert wait_for(lambda: holds_lock(os.getpid(), path_of(shm_name)))
        os.kill(creator.pid, signal.SIGKILL)
        waiter.join(timeout=30)
        assert not waiter.is_alive()
        assert len(errors) == 1
        assert isinstance(errors[0], SharedRegionError)
        assert "exited before the region was ready" in str(errors[0])
    finally:
        finish(creator)


def test_attach_times_out(shm_name: str) -> None:
    creator = spawn(STALLING_CREATOR, shm_name, "600", "ok")
    try:
        assert wait_for(path_of(shm_name).exists)
        t0 = time.monotonic()
        with pytest.raises(SharedRegionError, match="timed out"):
            HostPool(8, 4096, shared_name=shm_name, shared_mode="attach", attach_timeout=0.3)
        assert time.monotonic() - t0 < 20
    finally:
        finish(creator)


def test_an_attach_timeout_too_long_for_the_clock_waits_instead_of_failing(shm_name: str) -> None:
    # 2**63 s cannot be added to the monotonic clock: it used to panic (PanicException).
    with HostPool(8, 4096, shared_name=shm_name, attach_timeout=2.0**63) as pool:
        pool.view()[0, 0] = 7
        with HostPool(8, 4096, shared_name=shm_name, attach_timeout=2.0**63) as peer:
            assert peer.view()[0, 0] == 7


def test_a_file_planted_at_the_name_is_refused(shm_name: str, tmp_path: Path) -> None:
    # Another user could plant a region-shaped file there (open to all) or a link to one; a
    # pool must not attach to it, nor spin on it until its timeout.
    path = path_of(shm_name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 16)
        os.fchmod(fd, 0o666)  # past the umask
        os.close(fd)
        # Refused at once: spinning on it until the timeout would end in another error.
        with pytest.raises(SharedRegionError, match="not a region of this user's"):
            HostPool(8, 4096, shared_name=shm_name, attach_timeout=30.0)
        path.unlink()
        target = tmp_path / "elsewhere"
        target.write_bytes(b"")
        path.symlink_to(target)
        with pytest.raises(KVOffloadError):
            HostPool(8, 4096, shared_name=shm_name, attach_timeout=0.5)
    finally:
        path.unlink(missing_ok=True)


def test_an_exclusive_lock_held_for_good_times_out(shm_name: str) -> None:
    # A process stopped while holding the region's exclusive lock (a releaser's) must not keep
    # an attacher waiting past its attach_timeout.
    path = path_of(shm_name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 16)
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: it conflicts with the pool's
        with pytest.raises(SharedRegionError, match="timed out waiting for a lock"):
            HostPool(8, 4096, shared_name=shm_name, shared_mode="attach", attach_timeout=0.3)
        os.close(fd)
    finally:
        path.unlink(missing_ok=True)


def test_sizes_are_checked_on_attach(shm_name: str) -> None:
    with HostPool(8, 4096, shared_name=shm_name) as pool:
        pool.view()[:] = 7
        for n, cb in ((4, 4096), (8, 4095), (16, 2048)):
            with pytest.raises(SharedRegionError, match="holds 8 chunks of 4096 bytes"):
                HostPool(n, cb, shared_name=shm_name)
        assert (pool.view() == 7).all()
        with pytest.raises(SharedRegionError, match="already exists"):
            HostPool(8, 4096, shared_name=shm_name, shared_mode="create")
        with HostPool(8, 4096, shared_name=shm_name) as again:  # create_or_attach attaches
            assert not again.stats().creator
            assert (again.view() == 7).all()


def test_attach_to_nothing(shm_name: str) -> None:
    with pytest.raises(SharedRegionError, match="no shared region"):
        HostPool(8, 4096, shared_name=shm_name, shared_mode="attach")


def test_a_stale_region_is_replaced(shm_name: str) -> None:
    # A file no process holds (everyone using it was killed, janitor too) is stale.
    path_of(shm_name).write_bytes(b"\x00" * 8192)
    with HostPool(2, 4096, shared_name=shm_name) as pool:
        assert pool.stats().creator
    path_of(shm_name).write_bytes(b"\x00" * 8192)
    with pytest.raises(SharedRegionError, match="no shared region"):
        HostPool(2, 4096, shared_name=shm_name, shared_mode="attach")


def test_a_foreign_file_is_refused(shm_name: str) -> None:
    path = path_of(shm_name)
    path.write_bytes(b"\x01" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # held, so not stale
        with pytest.raises(SharedRegionError, match="not a kvoffload region"):
            HostPool(1, 4096, shared_name=shm_name)
        assert path.read_bytes() == b"\x01" * 8192
    finally:
        os.close(fd)
        path.unlink()


@pytest.mark.parametrize(
    "name", ["", ".hidden", "a/b", "sp ace", "x" * 201, "\udcff", "é", "a\x00"]
)
def test_bad_names(name: str) -> None:
    with pytest.raises(InvalidArgumentError):
        HostPool(1, 4096, shared_name=name)


@pytest.mark.parametrize("parent_keeps", ["pool", "view"])
def test_a_forked_child_holds_the_region_as_its_own_user(shm_name: str, parent_keeps: str) -> None:
    """A child forked from a user of a region shares its parent's open file, and so the parent's
    lock: the parent's release used to find itself the last user and remove the name while the
    child still mapped it (an attacher then made a new, empty region). The child now gets a hold
    of its own at the fork, so the name lasts until the last of them lets go (the parent lets go
    at once here, before the child could have taken a hold after the fork itself)."""
    pool = HostPool(4, 4096, shared_name=shm_name, register_cuda=False)
    pool.view()[0] = 1
    kept = pool.view() if parent_keeps == "view" else None  # a view alone holds it too
    if kept is not None:
        pool.close()
    to_child, from_parent = os.pipe()

    def child() -> int:
        signal.alarm(20)
        os.close(from_parent)
        os.read(to_child, 1)  # the parent has let go
        if not path_of(shm_name).exists():
            return 2
        attacher = HostPool(4, 4096, shared_name=shm_name, shared_mode="attach")
        shared = int(attacher.view()[0, 0]) == 1 and not attacher.stats().creator
        attacher.close()
        pool.close()
        return 0 if shared else 3

    pid = fork(child)
    os.close(to_child)
    pool.close()
    del kept
    os.write(from_parent, b"x")
    os.close(from_parent)
    assert exit_code(pid) == 0  # 2: the name went, 3: a new region
