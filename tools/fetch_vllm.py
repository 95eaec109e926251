#!/usr/bin/env python3
"""Fetch only vLLM 0.33.0's kv_offload sources from its PyPI wheel, verified, into a cache.

The wheel is 336 MB; the tests need about 50 of its pure-Python files (the ``vllm/v1/kv_offload``
package, two leaf modules it imports and the connector's two metrics modules). A wheel is a zip
whose central directory sits at its end, so this reads the directory and those members with HTTP
range requests against the wheel's URL (found through PyPI's JSON API): about 1.4 MB in all, most
of it the directory of the wheel's 5,800 files, and never the rest.

Trust: the wheel's sha256 and its ``RECORD``'s sha256 are pinned below. ``RECORD`` is checked
against its pin, and every extracted file against its line in ``RECORD``; nothing is written
unless all of them match. The index must list the wheel with the pinned sha256 (a range read
cannot hash the whole wheel).

Usage: tools/fetch_vllm.py [--dest DIR] [--quiet]
  DIR defaults to $KVOFFLOAD_VLLM_ORACLE, else ${XDG_CACHE_HOME:-~/.cache}/kvoffload/vllm-0.33.0;
  the files land in DIR/src (what tools/vllm_oracle.py imports). An existing, verified copy is
  kept without any network access.
Exit status: 0 done (or already there), 2 network unavailable, 1 anything else (a hash mismatch).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import ssl
import struct
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from urllib.parse import urljoin

VERSION = "0.33.0"
WHEEL = f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
RECORD = f"vllm-{VERSION}.dist-info/RECORD"
RECORD_SHA256 = "a860951d44545b1b68c2d1484b9a03bbde52f6eae34850a6c22741c60ac386c4"
#: The members tools/vllm_oracle.py imports (prefixes end in "/").
MEMBERS = (
    "vllm/v1/kv_offload/",
    "vllm/v1/metrics/cache_hit_source.py",
    "vllm/utils/math_utils.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py",
)
METADATA_URLS = (
    f"https://pypi.org/pypi/vllm/{VERSION}/json",
    "https://pypi.org/pypi/vllm/json",
    "https://pypi.org/simple/vllm/",
)
TIMEOUT_S = 60
#: Members closer than this are read in one request.
MERGE_GAP = 256 * 1024


class NetworkUnavailable(Exception):
    """The index or the file host could not be reached."""


class Verification(Exception):
    """A downloaded byte did not match its pinned or recorded hash."""


def default_dest() -> Path:
    """$KVOFFLOAD_VLLM_ORACLE, else the per-user cache directory."""
    env = os.environ.get("KVOFFLOAD_VLLM_ORACLE")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvoffload" / f"vllm-{VERSION}"


class Http:
    """GETs with a byte count, mapping connection failures to NetworkUnavailable."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        # The CA bundle pip is told to use, when there is one (as on machines behind a proxy).
        self.context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)

    def get(self, url: str, headers: dict[str, str] | None = None) -> bytes:
        """The body of ``url``."""
        req = urllib.request.Request(
            url, headers={"User-Agent": "kvoffload-fetch", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S, context=self.context) as resp:
                data: bytes = resp.read()
                if "Range" in (headers or {}) and resp.status != 206:
                    raise Verification(f"{url}: the server ignored the range request")
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise NetworkUnavailable(f"{url}: {e}") from e
        self.requests += 1
        self.bytes += len(data)
        return data

    def range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``url``."""
        data = self.get(url, {"Range": f"bytes={start}-{end - 1}"})
        if len(data) != end - start:
            raise Verification(f"asked for {end - start} bytes at {start}, got {len(data)}")
        return data


def wheel_url(http: Http) -> tuple[str, int]:
    """The wheel's URL and size, from PyPI's JSON API; its sha256 must be the pinned one."""
    for meta_url in METADATA_URLS:
        try:
            headers = {"Accept": "application/vnd.pypi.simple.v1+json"}
            doc = json.loads(http.get(meta_url, headers if "/simple/" in meta_url else None))
        except urllib.error.HTTPError:
            continue
        files = doc.get("files") or doc.get("releases", {}).get(VERSION) or doc.get("urls") or []
        for f in files:
            if f["filename"] != WHEEL:
                continue
            sha = (f.get("digests") or f.get("hashes") or {}).get("sha256")
            if sha != WHEEL_SHA256:
                raise Verification(f"{meta_url}: {WHEEL} has sha256 {sha}, pinned {WHEEL_SHA256}")
            return urljoin(meta_url, f["url"]), int(f["size"])
    raise Verification(f"no index lists {WHEEL}")


def _entries(http: Http, url: str, size: int) -> dict[str, tuple[int, int, int, int]]:
    """``{name: (local header offset, compressed size, method, name length)}`` of every member."""
    tail_len = min(size, 65536 + 22)
    tail = http.range(url, size - tail_len, size)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0:
        raise Verification("no end-of-central-directory record: not a zip")
    _, _, _, _, count, cd_size, cd_offset, _ = struct.unpack_from("<4s4H2LH", tail, at)
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF:  # zip64: its locator precedes the record
        (eocd64,) = struct.unpack_from("<Q", tail, at - 20 + 8)
        rec = http.range(url, eocd64, eocd64 + 56)
        count, cd_size, cd_offset = struct.unpack_from("<3Q", rec, 32)
    cd = http.range(url, cd_offset, cd_offset + cd_size)
    entries: dict[str, tuple[int, int, int, int]] = {}
    pos = 0
    for _ in range(count):
        fields = struct.unpack_from("<4s6H3L5H2L", cd, pos)
        method, csize, name_len, extra_len, comment_len, offset = (
            fields[4], fields[8], fields[10], fields[11], fields[12], fields[16],
        )  # fmt: skip
        name = cd[pos + 46 : pos + 46 + name_len].decode()
        if 0xFFFFFFFF in (csize, offset):
            csize, offset = _zip64_extra(cd[pos + 46 + name_len : pos + 46 + name_len + extra_len],
                                         fields[9], csize, offset)  # fmt: skip
        entries[name] = (offset, csize, method, name_len)
        pos += 46 + name_len + extra_len + comment_len
    return entries


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<2H", extra, pos)
        if tag == 1:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF:
                next(values)
            if csize == 0xFFFFFFFF:
                csize = next(values)
            if offset == 0xFFFFFFFF:
                offset = next(values)
        pos += 4 + length
    return csize, offset


def _members(
    http: Http,
    url: str,
    size: int,
    entries: dict[str, tuple[int, int, int, int]],
    names: list[str],
) -> dict[str, bytes]:
    """The uncompressed bytes of ``names``, read in as few range requests as gaps allow."""
    slack = 1024  # room for the local header's extra field, which may differ from the central one
    spans = sorted((entries[n][0], entries[n][0] + 30 + entries[n][3] + entries[n][1] + slack, n)
                   for n in names)  # fmt: skip
    groups: list[list[tuple[int, int, str]]] = []
    for span in spans:
        if groups and span[0] - groups[-1][-1][1] < MERGE_GAP:
            groups[-1].append(span)
        else:
            groups.append([span])
    out: dict[str, bytes] = {}
    for group in groups:
        start, end = group[0][0], min(max(s[1] for s in group), size)
        blob = http.range(url, start, end)
        for offset, _, name in group:
            _, csize, method, _ = entries[name]
            header = blob[offset - start : offset - start + 30]
            sig, *_, name_len, extra_len = struct.unpack("<4s5H3L2H", header)
            if sig != b"PK\x03\x04":
                raise Verification(f"{name}: bad local header")
            data_at = offset - start + 30 + name_len + extra_len
            data = blob[data_at : data_at + csize]
            if len(data) < csize:  # a long local extra field: read the member on its own
                data = http.range(url, start + data_at, start + data_at + csize)
            if method == 0:
                out[name] = data
            elif method == 8:
                out[name] = zlib.decompress(data, -15)
            else:
                raise Verification(f"{name}: compression method {method} not supported")
    return out


def _record_hashes(record: bytes) -> dict[str, str]:
    return {row[0]: row[1] for row in csv.reader(io.StringIO(record.decode())) if len(row) >= 2}


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def verified_copy(src: Path) -> bool:
    """Whether ``src`` holds every wanted member, each matching the pinned RECORD."""
    record_path, stamp = src / RECORD, src / "VLLM_VERSION"
    if not record_path.is_file() or not stamp.is_file() or stamp.read_text().strip() != VERSION:
        return False
    record = record_path.read_bytes()
    if hashlib.sha256(record).hexdigest() != RECORD_SHA256:
        return False
    hashes = _record_hashes(record)
    wanted = [n for n in hashes if n.startswith(MEMBERS)]
    return bool(wanted) and all(
        (src / n).is_file() and _digest((src / n).read_bytes()) == hashes[n] for n in wanted
    )


def fetch(dest: Path, quiet: bool = False) -> None:
    """Make ``dest/src`` a verified copy of the wanted members (no network if it already is)."""
    src = dest / "src"
    if verified_copy(src):
        if not quiet:
            print(f"fetch_vllm: vLLM {VERSION} sources already in {src} (verified)")
        return
    began = time.monotonic()
    http = Http()
    url, size = wheel_url(http)
    entries = _entries(http, url, size)
    record = _members(http, url, size, entries, [RECORD])[RECORD]
    if hashlib.sha256(record).hexdigest() != RECORD_SHA256:
        raise Verification(f"{RECORD} does not match its pinned sha256")
    hashes = _record_hashes(record)
    names = [n for n in entries if n.startswith(MEMBERS) and not n.endswith("/")]
    files = _members(http, url, size, entries, names)
    for name, data in files.items():
        if _digest(data) != hashes.get(name):
            raise Verification(f"{name} does not match the wheel's RECORD")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        staged = Path(tmp) / "src"
        for name, data in {**files, RECORD: record}.items():
            path = staged / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        (staged / "VLLM_VERSION").write_text(VERSION + "\n")
        if src.exists():
            shutil.rmtree(src)
        staged.rename(src)
    if not quiet:
        print(
            f"fetch_vllm: {len(files)} files of vLLM {VERSION} ({sum(map(len, files.values())):,} "
            f"bytes) verified into {src}: {http.requests} requests, {http.bytes:,} bytes "
            f"downloaded of the {size:,}-byte wheel, {time.monotonic() - began:.1f} s"
        )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=None)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        fetch(args.dest or default_dest(), args.quiet)
    except NetworkUnavailable as e:
        print(f"fetch_vllm: network unavailable ({e})", file=sys.stderr)
        return 2
    except (Verification, urllib.error.HTTPError) as e:
        print(f"fetch_vllm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
