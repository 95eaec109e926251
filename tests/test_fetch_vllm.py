"""tools/fetch_vllm.py without a network: its zip reader over range reads of an in-memory wheel."""

from __future__ import annotations

import io
import zipfile
from typing import Any

import pytest

import _driver

fetch_vllm: Any = _driver._load_tool("fetch_vllm")


class MemoryHttp:
    """Range reads of bytes held in memory, counted like the real client's."""

    def __init__(self, blob: bytes) -> None:
        self.blob, self.requests, self.bytes = blob, 0, 0

    def range(self, url: str, start: int, end: int) -> bytes:
        self.requests += 1
        self.bytes += end - start
        return self.blob[start:end]


def _wheel(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for i, (name, data) in enumerate(members.items()):
            z.writestr(name, data, zipfile.ZIP_DEFLATED if i % 2 else zipfile.ZIP_STORED)
    return out.getvalue()


def test_reads_only_the_members_asked_for() -> None:
    wanted = {f"vllm/v1/kv_offload/m{i}.py": b"x = %d\n" % i * 50 for i in range(5)}
    other = {f"vllm/big/f{i}.bin": bytes(range(256)) * 2000 for i in range(4)}
    blob = _wheel({**other, **wanted, "vllm/tail.py": b"pass\n"})
    http = MemoryHttp(blob)
    entries = fetch_vllm._entries(http, "mem", len(blob))
    assert set(entries) == {*other, *wanted, "vllm/tail.py"}
    got = fetch_vllm._members(http, "mem", len(blob), entries, list(wanted))
    assert got == wanted
    assert http.bytes < len(blob) / 4  # the big members were never read


def test_record_digests_and_verified_copy(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"print('hi')\n"
    record = f"vllm/utils/math_utils.py,{fetch_vllm._digest(data)},{len(data)}\n".encode()
    monkeypatch.setattr(fetch_vllm, "RECORD_SHA256", fetch_vllm.hashlib.sha256(record).hexdigest())
    src = tmp_path / "src"
    (src / "vllm/utils").mkdir(parents=True)
    (src / "vllm/utils/math_utils.py").write_bytes(data)
    (src / fetch_vllm.RECORD).parent.mkdir(parents=True)
    (src / fetch_vllm.RECORD).write_bytes(record)
    (src / "VLLM_VERSION").write_text(fetch_vllm.VERSION + "\n")
    assert fetch_vllm.verified_copy(src)
    (src / "vllm/utils/math_utils.py").write_bytes(data + b"# changed\n")
    assert not fetch_vllm.verified_copy(src)


# --- tools/vllm_oracle.py, without loading vLLM ---

vllm_oracle: Any = _driver._load_tool("vllm_oracle")


def test_oracle_names_a_module_vllm_needs_that_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's sources import typing_extensions; without it the oracle says so instead of failing
    # part-way through its imports (and the vLLM tests skip, or fail, with that reason).
    if vllm_oracle.unavailable_reason() is not None:
        pytest.skip(f"the oracle's sources are not in place: {vllm_oracle.unavailable_reason()}")
    monkeypatch.setattr(vllm_oracle, "_NEEDED_MODULES", ("kvoffload_no_such_module",))
    reason = vllm_oracle.unavailable_reason()
    assert reason is not None
    assert "kvoffload_no_such_module" in reason
    assert "pip install kvoffload_no_such_module" in reason


def test_oracle_stand_ins_can_be_found_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # A load that fails part-way leaves its stand-ins in sys.modules; the next load asks
    # importlib.util.find_spec about them, which raises ValueError on a module without a spec.
    import importlib.util
    import sys
    from pathlib import Path

    for name, package in (("kvoffload_stand_in", None), ("kvoffload_stand_in_pkg", "/nowhere")):
        module = vllm_oracle._module(name, None if package is None else Path(package))
        monkeypatch.setitem(sys.modules, name, module)
        spec = importlib.util.find_spec(name)
        assert spec is module.__spec__
        assert spec.name == name
        if package is None:
            assert spec.submodule_search_locations is None
        else:
            assert spec.submodule_search_locations == module.__path__ == [package]
