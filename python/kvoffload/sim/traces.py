"""Trace files: kvoffload's JSONL request traces and libCacheSim's object traces.

- **JSONL requests** (serving mode; docs/sim.md): one JSON object per line, with ``req_id``
  (string), ``arrival`` (seconds, a finite number >= 0), ``block_hashes`` (one list of hex
  strings per KV group), ``output_tokens`` (int, 0 to `MAX_OUTPUT_TOKENS`, default 0) and optionally
  ``output_hashes`` (like ``block_hashes``; when given, these are the output blocks stored, and
  ``output_tokens`` only sets the decode time). Blank lines are skipped.
- **libCacheSim object traces** (classic mode), read as (time, object id, size) arrays:
  ``txt`` (one numeric object id per line, libCacheSim's plain-text trace), ``csv`` (columns chosen
  1-based, as libCacheSim's ``time-col``/``obj-id-col``/``obj-size-col``), and ``oracleGeneral``
  (binary little-endian records of ``uint32 time, uint64 obj_id, uint32 size, int64
  next_access_vtime``, 24 bytes, as in libCacheSim's ``oracleGeneralBin.h``; not zstd-compressed;
  records of size 0 are skipped, as libCacheSim's reader skips them).

Text files must be UTF-8. Malformed input raises `kvoffload.TraceFormatError` naming the file and
line (or record).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from kvoffload.errors import InvalidArgumentError, TraceFormatError
from kvoffload.sim.generators import check_alpha
from kvoffload.sim.model import SimRequest

__all__ = [
    "MAX_OUTPUT_TOKENS",
    "OBJECT_FORMATS",
    "ORACLE_GENERAL_DTYPE",
    "CsvColumns",
    "ObjectTrace",
    "detect_format",
    "read_jsonl",
    "read_object_trace",
    "write_jsonl",
    "write_object_trace",
    "zipf_object_trace",
]

#: One oracleGeneral record (packed, little-endian, 24 bytes).
ORACLE_GENERAL_DTYPE = np.dtype(
    [("time", "<u4"), ("obj_id", "<u8"), ("size", "<u4"), ("next_access_vtime", "<i8")]
)
OBJECT_FORMATS = ("txt", "csv", "oracleGeneral")
#: The most ``output_tokens`` a JSONL request may have (2**24, beyond any model's context): the
#: simulator builds a key per output block, so a bigger count only exhausts memory.
MAX_OUTPUT_TOKENS = 2**24
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True, eq=False)
class ObjectTrace:
    """An object trace: one request per element (classic cache experiments); compared by id."""

    times: npt.NDArray[np.uint64]
    obj_ids: npt.NDArray[np.uint64]
    sizes: npt.NDArray[np.uint64]

    @classmethod
    def from_ids(cls, obj_ids: Sequence[int] | npt.NDArray[Any]) -> ObjectTrace:
        """A trace of unit-size objects at times 0, 1, 2, ..."""
        ids = np.asarray(obj_ids, dtype=np.uint64)
        n = len(ids)
        return cls(np.arange(n, dtype=np.uint64), ids, np.ones(n, dtype=np.uint64))

    def __len__(self) -> int:
        return len(self.obj_ids)

    @property
    def num_objects(self) -> int:
        """Distinct object ids."""
        return len(np.unique(self.obj_ids))


def zipf_object_trace(
    requests: int, objects: int, alpha: float = 0.8, seed: int = 0
) -> ObjectTrace:
    """A seeded object trace: ids 1..objects drawn with probability proportional to rank^-alpha."""
    if requests < 0 or objects < 1:
        raise InvalidArgumentError("a Zipf trace needs requests >= 0 and objects >= 1")
    check_alpha(alpha)
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):  # rank^alpha beyond a float: weight 0, as it nearly is
        weights = 1.0 / np.arange(1, objects + 1, dtype=np.float64) ** alpha
    ids = rng.choice(objects, size=requests, p=weights / weights.sum()) + 1
    return ObjectTrace.from_ids(ids)


@dataclass(frozen=True)
class CsvColumns:
    """Where a CSV trace keeps its fields (1-based; ``None``: absent)."""

    obj_id: int = 2
    time: int | None = 1
    size: int | None = 3
    delimiter: str = ","
    has_header: bool = False


def detect_format(path: str | Path) -> str:
    """Guess a trace's format from its name: jsonl, csv, txt or oracleGeneral."""
    name = Path(path).name.lower()
    if name.endswith(".zst"):
        raise TraceFormatError(f"{path}: zstd-compressed traces are not read; decompress first")
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith(".csv"):
        return "csv"
    if name.endswith(".txt"):
        return "txt"
    if "oraclegeneral" in name or name.endswith(".bin"):
        return "oracleGeneral"
    raise TraceFormatError(
        f"{path}: cannot tell the trace format from the name; pass one of "
        f"jsonl, {', '.join(OBJECT_FORMATS)}"
    )


def _utf8_lines(f: IO[str], path: str | Path) -> Iterator[tuple[int, str]]:
    """The lines of ``f`` (opened with ``errors="surrogateescape"``), numbered from 1.

    A line that is not UTF-8 raises TraceFormatError naming it (an undecodable byte reads as a
    lone surrogate, which the strict encoding refuses).
    """
    for lineno, line in enumerate(f, 1):
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as e:
            byte = ord(line[e.start]) - 0xDC00
            raise TraceFormatError(
                f"{path}:{lineno}: not UTF-8 text (byte 0x{byte:02x} at column {e.start + 1})"
            ) from None
        yield lineno, line


# -- JSONL request traces ----------------------------------------------------------------------


def _hashes(value: Any, where: str, field: str) -> tuple[tuple[bytes, ...], ...]:
    if not isinstance(value, list) or not all(isinstance(g, list) for g in value):
        raise TraceFormatError(f"{where}: {field} must be a list of lists (one per KV group)")
    try:
        return tuple(tuple(bytes.fromhex(h) for h in group) for group in value)
    except (TypeError, ValueError):
        raise TraceFormatError(f"{where}: {field} must hold hex strings") from None


def _parse_request(obj: Any, where: str) -> SimRequest:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: a request must be a JSON object")
    unknown = set(obj) - {"req_id", "arrival", "block_hashes", "output_tokens", "output_hashes"}
    if unknown:
        raise TraceFormatError(f"{where}: unknown field(s) {sorted(unknown)}")
    for field in ("req_id", "arrival", "block_hashes"):
        if field not in obj:
            raise TraceFormatError(f"{where}: missing field {field!r}")
    req_id, arrival = obj["req_id"], obj["arrival"]
    output_tokens = obj.get("output_tokens", 0)
    if not isinstance(req_id, str):
        raise TraceFormatError(f"{where}: req_id must be a string")
    try:  # Python's JSON reads NaN, Infinity, 1e999 and ints beyond any float too
        seconds = math.nan if isinstance(arrival, bool) else float(arrival)
    except (TypeError, ValueError, OverflowError):
        seconds = math.nan
    if not isinstance(arrival, int | float) or not 0 <= seconds < math.inf:
        raise TraceFormatError(
            f"{where}: arrival must be a finite number >= 0, got {str(arrival)[:40]}"
        )
    if (
        isinstance(output_tokens, bool)
        or not isinstance(output_tokens, int)
        or not 0 <= output_tokens <= MAX_OUTPUT_TOKENS
    ):
        raise TraceFormatError(
            f"{where}: output_tokens must be an int from 0 to {MAX_OUTPUT_TOKENS:,} (2**24), "
            f"got {output_tokens!r}"
        )
    blocks = _hashes(obj["block_hashes"], where, "block_hashes")
    if not blocks:
        raise TraceFormatError(f"{where}: block_hashes needs at least one KV group")
    out = obj.get("output_hashes")
    output_hashes = None if out is None else _hashes(out, where, "output_hashes")
    if output_hashes is not None and len(output_hashes) != len(blocks):
        raise TraceFormatError(f"{where}: output_hashes must have one list per KV group")
    return SimRequest(req_id, seconds, blocks, output_tokens, output_hashes)


def read_jsonl(path: str | Path) -> list[SimRequest]:
    """Read a JSONL request trace, sorted by arrival (stable); request ids must be unique."""
    requests: list[SimRequest] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in _utf8_lines(f, path):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{where}: not JSON ({e.msg})") from None
            request = _parse_request(obj, where)
            if request.req_id in seen:
                raise TraceFormatError(f"{where}: duplicate req_id {request.req_id!r}")
            seen.add(request.req_id)
            requests.append(request)
    requests.sort(key=lambda r: r.arrival)
    return requests


def write_jsonl(requests: Iterable[SimRequest], path: str | Path) -> None:
    """Write requests as a JSONL trace that `read_jsonl` reads back."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            obj: dict[str, Any] = {
                "req_id": r.req_id,
                "arrival": r.arrival,
                "block_hashes": [[h.hex() for h in g] for g in r.block_hashes],
                "output_tokens": r.output_tokens,
            }
            if r.output_hashes is not None:
                obj["output_hashes"] = [[h.hex() for h in g] for g in r.output_hashes]
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")


# -- object traces -----------------------------------------------------------------------------


def _uint(text: str, where: str, what: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceFormatError(
            f"{where}: {what} must be an integer, got {text.strip()!r}"
        ) from None
    if not 0 <= value < 2**64:
        raise TraceFormatError(f"{where}: {what} {value} is outside 0..2**64-1")
    return value


def _read_txt(path: Path) -> ObjectTrace:
    ids: list[int] = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in _utf8_lines(f, path):
            if line.strip():
                ids.append(_uint(line, f"{path}:{lineno}", "object id"))
    return ObjectTrace.from_ids(ids)


def _read_csv(path: Path, cols: CsvColumns) -> ObjectTrace:
    times: list[int] = []
    ids: list[int] = []
    sizes: list[int] = []
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        lines = (line for _, line in _utf8_lines(f, path))
        for lineno, row in enumerate(csv.reader(lines, delimiter=cols.delimiter), 1):
            if (lineno == 1 and cols.has_header) or not row:
                continue
            where = f"{path}:{lineno}"
            need = max(c for c in (cols.obj_id, cols.time, cols.size) if c is not None)
            if len(row) < need:
                raise TraceFormatError(f"{where}: {len(row)} column(s), need {need}")
            ids.append(_uint(row[cols.obj_id - 1], where, "object id"))
            times.append(
                len(times) if cols.time is None else _uint(row[cols.time - 1], where, "time")
            )
            sizes.append(1 if cols.size is None else _uint(row[cols.size - 1], where, "size"))
    return ObjectTrace(
        np.array(times, dtype=np.uint64),
        np.array(ids, dtype=np.uint64),
        np.array(sizes, dtype=np.uint64),
    )


def _read_oracle_general(path: Path) -> ObjectTrace:
    data = path.read_bytes()
    if data[:4] == _ZSTD_MAGIC:
        raise TraceFormatError(f"{path}: zstd-compressed; decompress first (zstd -d)")
    if len(data) % ORACLE_GENERAL_DTYPE.itemsize:
        raise TraceFormatError(
            f"{path}: {len(data)} bytes is not a whole number of 24-byte oracleGeneral records "
            f"(record {len(data) // ORACLE_GENERAL_DTYPE.itemsize} is cut short)"
        )
    rec = np.frombuffer(data, dtype=ORACLE_GENERAL_DTYPE)
    # libCacheSim's reader skips zero-size requests (ignore_size_zero_req); so does this one.
    rec = rec[rec["size"] != 0]
    return ObjectTrace(
        rec["time"].astype(np.uint64), rec["obj_id"].copy(), rec["size"].astype(np.uint64)
    )


def read_object_trace(
    path: str | Path, fmt: str | None = None, csv_columns: CsvColumns | None = None
) -> ObjectTrace:
    """Read a libCacheSim object trace (``fmt``: txt, csv, oracleGeneral; None guesses)."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt == "txt":
        return _read_txt(path)
    if fmt == "csv":
        return _read_csv(path, csv_columns or CsvColumns())
    if fmt == "oracleGeneral":
        return _read_oracle_general(path)
    raise TraceFormatError(f"{path}: {fmt!r} is not an object-trace format {OBJECT_FORMATS}")


def write_object_trace(trace: ObjectTrace, path: str | Path, fmt: str) -> None:
    """Write ``trace`` as txt, csv (time,obj_id,size; no header) or oracleGeneral."""
    if fmt == "txt":
        Path(path).write_text("".join(f"{i}\n" for i in trace.obj_ids.tolist()))
    elif fmt == "csv":
        rows = zip(trace.times.tolist(), trace.obj_ids.tolist(), trace.sizes.tolist(), strict=True)
        Path(path).write_text("".join(f"{t},{o},{s}\n" for t, o, s in rows))
    elif fmt == "oracleGeneral":
        rec = np.zeros(len(trace), dtype=ORACLE_GENERAL_DTYPE)
        rec["time"] = trace.times
        rec["obj_id"] = trace.obj_ids
        rec["size"] = trace.sizes
        rec["next_access_vtime"] = -1
        Path(path).write_bytes(rec.tobytes())
    else:
        raise TraceFormatError(f"{fmt!r} is not an object-trace format {OBJECT_FORMATS}")
