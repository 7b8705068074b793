"""Raw request traces: streaming readers, statistics, download and conversion.

What it provides
    :func:`iter_records` streams the requests of a trace file as
    :class:`TraceRecord` objects, one line (or one Parquet batch) at a time,
    validating every record. Four formats are read (``docs/traces.md``):

    * ``mooncake``: Mooncake FAST'25 JSON Lines (``timestamp`` in ms,
      ``input_length``, ``output_length``, chained ``hash_ids`` of 512-token
      blocks; an optional ``session_id`` string is kept);
    * ``azure``: Azure LLM inference 2023 CSV (``TIMESTAMP,ContextTokens,
      GeneratedTokens``, absolute timestamps with 7 fractional digits, made
      relative to the first record exactly, in integer nanoseconds);
    * ``csv`` and ``parquet``: kvsim's own schema (``CSV_COLUMNS``).

    Mooncake JSONL and CSV files may be gzip-compressed (a ``.gz`` name or
    the gzip magic bytes); they are decompressed as they stream.

    :func:`trace_stats` summarises a trace (counts, rates, arrival
    burstiness, length percentiles, prefix reuse and reuse distance of
    hash-id traces); :func:`fetch_trace`
    downloads a published trace into a cache folder and verifies its digest;
    :func:`resolve_trace` finds a published trace by name for a scenario
    (``$KVSIM_TRACES``, then the fetch cache) and :func:`trace_digest` is the
    sha256 of a trace's content that a resolved scenario records;
    :func:`convert_trace` rewrites a trace in another format. All three back
    the ``kvsim trace stats|fetch|convert`` commands (:func:`add_trace_parser`).

Conventions
    * Bad input raises :class:`~sim.errors.InputError` with
      ``key = "line N"`` (the 1-based physical line; for CSV the header is
      line 1; for Parquet, N is the 1-based row number). With
      ``skip_bad=True`` a bad record is skipped and counted in a
      :class:`BadLines` instead; problems with the file itself (missing,
      unreadable, bad header or schema) are never skipped.
    * ``arrival_s`` is in seconds. Mooncake, CSV and Parquet times are kept
      as stored (they are already relative to the trace start; the Mooncake
      traces start at 0); Azure's absolute times are made relative to the
      first record. Timestamps must not decrease from one record to the next.
    * Nothing reads a whole file into memory, and every file written goes to
      a temporary name in the target folder first and is renamed into place
      only when complete.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import math
import os
import secrets
import urllib.error
import urllib.request
import zlib
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from http.client import HTTPException
from pathlib import Path
from typing import IO, Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq

from sim.errors import InputError

__all__ = [
    "AZURE_HEADER",
    "CSV_COLUMNS",
    "FORMATS",
    "KNOWN_TRACES",
    "TRACES_ENV",
    "WRITABLE_FORMATS",
    "BadLines",
    "KnownTrace",
    "TraceRecord",
    "convert_trace",
    "default_cache_dir",
    "detect_format",
    "fetch_trace",
    "format_stats",
    "iter_mooncake_records",
    "iter_records",
    "no_requests",
    "output_format",
    "resolve_trace",
    "trace_digest",
    "trace_has_requests",
    "trace_search_dirs",
    "trace_stats",
    "write_records",
]

FORMATS = ("mooncake", "azure", "csv", "parquet")
WRITABLE_FORMATS = ("mooncake", "csv", "parquet")
MOONCAKE_BLOCK_TOKENS = 512
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
CSV_COLUMNS = ("arrival_s", "input_tokens", "output_tokens", "hash_ids", "block_tokens",
               "prefix_group", "prefix_tokens", "session_id")
CSV_REQUIRED = CSV_COLUMNS[:3]

_INT64_MAX = (1 << 63) - 1
_PARQUET_BATCH = 8192
_EPOCH = datetime(1970, 1, 1)
_SECOND = timedelta(seconds=1)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace file, as stored (validated, not yet expanded).

    Attributes:
        line: 1-based physical line (CSV: the header is line 1; Parquet: row number).
        arrival_s: seconds from the trace start (Azure: from its first record).
        input_tokens: prompt tokens (>= 1).
        output_tokens: generated tokens (>= 1).
        hash_ids: chained block ids, ``ceil(input_tokens / block_tokens)`` of
            them, or ``None`` when the trace has no block ids.
        block_tokens: tokens per hash id (Mooncake: 512).
        prefix_group: requests of one group share their first ``prefix_tokens``
            prompt tokens (kvsim CSV/Parquet), else ``None``.
        prefix_tokens: length of the group's shared prefix.
        session_id: the conversation, where the trace names it.
    """

    line: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None
    block_tokens: int | None
    prefix_group: int | None
    prefix_tokens: int | None
    session_id: str | None


@dataclass
class BadLines:
    """Records skipped under ``skip_bad``: how many, and the first few problems."""

    count: int = 0
    examples: list[str] = field(default_factory=list)
    max_examples: ClassVar[int] = 5

    def add(self, exc: InputError) -> None:
        """Count one skipped record (``exc`` names its line and problem)."""
        self.count += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(f"{exc.key}: {exc.problem}")


class _FieldError(Exception):
    """A field-level problem; the reader adds the file and line."""

    def __init__(self, problem: str, allowed: str) -> None:
        super().__init__(problem, allowed)
        self.problem = problem
        self.allowed = allowed


# ----------------------------------------------------------------------------------------------
# Format detection and file access
# ----------------------------------------------------------------------------------------------

_GZIP_MAGIC = b"\x1f\x8b"


def _is_gzip(path: Path, head: bytes) -> bool:
    """A gzip-compressed file: a ``.gz`` name or the gzip magic bytes."""
    return path.suffix.lower() == ".gz" or head.startswith(_GZIP_MAGIC)


def _inner_suffix(path: Path) -> str:
    """The suffix that tells the format (``t.jsonl.gz`` -> ``.jsonl``)."""
    name = path.name
    if name.lower().endswith(".gz"):
        name = name[:-3]
    return Path(name).suffix.lower()


def _head(path: Path, source: str, size: int = 4096) -> bytes:
    """The first ``size`` bytes of the file's content (decompressed when gzip-compressed)."""
    try:
        with path.open("rb") as f:
            raw = f.read(size)
    except FileNotFoundError as exc:
        raise InputError(source, "", "no such file", "an existing trace file") from exc
    except OSError as exc:
        raise InputError(source, "", f"cannot read ({exc.strerror or exc})", "a readable trace file") from exc
    if not _is_gzip(path, raw):
        return raw
    try:
        return zlib.decompressobj(wbits=31).decompress(raw, size)
    except zlib.error as exc:
        raise InputError(source, "", f"corrupt gzip data ({exc})",
                         "a gzip-compressed or plain trace file") from None


def _first_line(head: bytes) -> str:
    text = head.split(b"\n", 1)[0].decode("utf-8", "replace")
    return text.removeprefix("\ufeff").strip()


def _is_azure_header(line: str) -> bool:
    return tuple(c.strip() for c in line.split(",")) == AZURE_HEADER


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of an existing trace file, by suffix and first line.

    ``.jsonl``/``.ndjson`` -> mooncake; ``.parquet``/``.pq`` -> parquet;
    ``.csv`` -> azure when its header is ``TIMESTAMP,ContextTokens,GeneratedTokens``,
    else csv (kvsim's schema). Other names are sniffed (Parquet magic, a JSON
    object, either CSV header). A gzip-compressed file (a ``.gz`` name or the
    gzip magic bytes) is told by the name without ``.gz`` and its content.

    Raises:
        InputError: the file is missing or unreadable, or the format cannot be told.
    """
    p = Path(path)
    source = str(path)
    head = _head(p, source)
    suffix = _inner_suffix(p)
    if suffix in (".jsonl", ".ndjson"):
        return "mooncake"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    first = _first_line(head)
    if suffix == ".csv":
        return "azure" if _is_azure_header(first) else "csv"
    if head.startswith(b"PAR1"):
        return "parquet"
    if first.startswith("{"):
        return "mooncake"
    if _is_azure_header(first):
        return "azure"
    if "arrival_s" in (c.strip() for c in first.split(",")):
        return "csv"
    raise InputError(source, "", "cannot tell the trace format from the file name or first line",
                     "--format " + "|".join(FORMATS))


def output_format(path: str | os.PathLike[str]) -> str:
    """The format to write ``path`` in, from its suffix."""
    suffix = Path(path).suffix.lower()
    fmt = {".jsonl": "mooncake", ".ndjson": "mooncake", ".csv": "csv", ".parquet": "parquet",
           ".pq": "parquet"}.get(suffix)
    if fmt is None:
        raise InputError(str(path), "", "cannot tell the output format from the file name",
                         "a .jsonl, .csv or .parquet name, or --to " + "|".join(WRITABLE_FORMATS))
    return fmt


class _GzipLines:
    """Lines of a gzip stream; corrupt or truncated data becomes one :class:`InputError`."""

    def __init__(self, f: IO[bytes], source: str) -> None:
        self.f = f
        self.source = source
        self.n = 0

    def __iter__(self) -> _GzipLines:
        return self

    def __next__(self) -> bytes:
        try:
            line = self.f.readline()
        except (OSError, EOFError, zlib.error) as exc:
            raise InputError(self.source, f"line {self.n + 1}", f"corrupt gzip data ({exc})",
                             "a complete gzip file (or the plain trace)") from None
        if not line:
            raise StopIteration
        self.n += 1
        return line


@contextmanager
def _open_binary(path: Path, source: str) -> Iterator[Any]:
    """The file's lines as bytes; a gzip-compressed file (``.gz`` or the magic bytes) is
    decompressed on the fly. Nothing is read ahead beyond the first buffer (pipes stream)."""
    try:
        f = path.open("rb")
    except FileNotFoundError as exc:
        raise InputError(source, "", "no such file", "an existing trace file") from exc
    except OSError as exc:
        raise InputError(source, "", f"cannot read ({exc.strerror or exc})", "a readable trace file") from exc
    with f:
        if path.suffix.lower() == ".gz" or f.peek(2)[:2] == _GZIP_MAGIC:
            with gzip.GzipFile(fileobj=f, mode="rb") as gz:
                yield _GzipLines(io.BufferedReader(gz, 1 << 16), source)
        else:
            yield f


# ----------------------------------------------------------------------------------------------
# Field parsing (CSV strings and Parquet values alike)
# ----------------------------------------------------------------------------------------------

def _empty(v: object) -> bool:
    return v is None or (isinstance(v, str) and not v.strip())


def _int(v: object, name: str, minimum: int) -> int:
    if isinstance(v, str):
        t = v.strip()
        digits = t[1:] if t.startswith("-") else t
        if not (digits.isascii() and digits.isdigit()):
            raise _FieldError(f"{name} {v!r} is not an integer", f"an integer >= {minimum}")
        value = int(t)
    elif type(v) is int:
        value = v
    else:
        raise _FieldError(f"{name} {v!r} is not an integer", f"an integer >= {minimum}")
    if value < minimum:
        raise _FieldError(f"{name} {value}", f"an integer >= {minimum}")
    return value


def _req_int(v: object, name: str, minimum: int) -> int:
    if _empty(v):
        raise _FieldError(f"missing {name}", f"an integer >= {minimum}")
    return _int(v, name, minimum)


def _opt_int(v: object, name: str, minimum: int) -> int | None:
    return None if _empty(v) else _int(v, name, minimum)


def _seconds(v: object) -> float:
    allowed = "a finite number of seconds >= 0"
    if _empty(v):
        raise _FieldError("missing arrival_s", allowed)
    if isinstance(v, str):
        try:
            value = float(v)
        except ValueError:
            raise _FieldError(f"arrival_s {v!r} is not a number", allowed) from None
    elif type(v) in (int, float):
        value = float(v)  # type: ignore[arg-type]
    else:
        raise _FieldError(f"arrival_s {v!r} is not a number", allowed)
    if not math.isfinite(value) or value < 0:
        raise _FieldError(f"arrival_s {value!r}", allowed)
    return value


def _hash_ids(v: object) -> tuple[int, ...] | None:
    allowed = "non-negative integers (space-separated in CSV)"
    if _empty(v):
        return None
    if isinstance(v, str):
        parts = v.split()
        if not all(p.isascii() and p.isdigit() for p in parts):
            bad = next(p for p in parts if not (p.isascii() and p.isdigit()))
            raise _FieldError(f"hash id {bad!r} is not a non-negative integer", allowed)
        return tuple(int(p) for p in parts)
    if isinstance(v, (list, tuple)):
        for h in v:
            if type(h) is not int or h < 0:
                raise _FieldError(f"hash id {h!r} is not a non-negative integer", allowed)
        return tuple(v)
    raise _FieldError(f"hash_ids {v!r} is not a list of integers", allowed)


def _session(v: object) -> str | None:
    if _empty(v):
        return None
    if isinstance(v, str):
        return v
    if type(v) is int:
        return str(v)
    raise _FieldError(f"session_id {v!r} is not a string", "a string")


class _Checker:
    """Semantic checks shared by the kvsim CSV and Parquet readers."""

    def __init__(self, default_block_tokens: int | None) -> None:
        self.default_bt = default_block_tokens
        self.prev = 0.0
        self.groups: dict[int, int] = {}

    def record(self, n: int, values: dict[str, object]) -> TraceRecord:
        get = values.get
        arrival = _seconds(get("arrival_s"))
        if arrival < self.prev:
            raise _FieldError(f"arrival_s {arrival!r} is smaller than the previous record's {self.prev!r}",
                              "non-decreasing arrival times")
        inp = _req_int(get("input_tokens"), "input_tokens", 1)
        out = _req_int(get("output_tokens"), "output_tokens", 1)
        ids = _hash_ids(get("hash_ids"))
        bt = _opt_int(get("block_tokens"), "block_tokens", 1)
        if ids is not None:
            if bt is None:
                bt = self.default_bt
            if bt is None:
                raise _FieldError("hash_ids without block_tokens",
                                  "a block_tokens value, or --block-tokens N")
            want = -(-inp // bt)
            if len(ids) != want:
                raise _FieldError(f"{len(ids)} hash_ids for input_tokens {inp}",
                                  f"ceil(input_tokens / {bt}) = {want} ids")
        group = _opt_int(get("prefix_group"), "prefix_group", 0)
        ptok = _opt_int(get("prefix_tokens"), "prefix_tokens", 1)
        if (group is None) != (ptok is None):
            raise _FieldError("prefix_group and prefix_tokens must be given together", "both or neither")
        if group is not None and ptok is not None:
            if ids is not None:
                raise _FieldError("both hash_ids and prefix_group",
                                  "one kind of prefix information per record")
            if ptok > inp:
                raise _FieldError(f"prefix_tokens {ptok} exceeds input_tokens {inp}",
                                  "prefix_tokens <= input_tokens")
            known = self.groups.get(group)
            if known is not None and known != ptok:
                raise _FieldError(f"prefix_tokens {ptok} for prefix_group {group}, "
                                  f"earlier records say {known}",
                                  "one prefix_tokens value per prefix_group")
        session = _session(get("session_id"))
        # accept: only now update the state
        if group is not None and ptok is not None:
            self.groups[group] = ptok
        self.prev = arrival
        return TraceRecord(n, arrival, inp, out, ids, bt, group, ptok, session)


# ----------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------

def _skip(exc: InputError, skip_bad: bool, bad: BadLines | None) -> None:
    if not skip_bad or bad is None:
        raise exc
    bad.add(exc)


def iter_records(path: str | os.PathLike[str], fmt: str | None = None, *, skip_bad: bool = False,
                 bad: BadLines | None = None, block_tokens: int | None = None) -> Iterator[TraceRecord]:
    """Stream the validated records of a trace file.

    Args:
        path: the trace file.
        fmt: one of :data:`FORMATS`; ``None`` detects it (:func:`detect_format`).
        skip_bad: skip bad records instead of raising; they are counted in ``bad``,
            which is then required.
        bad: the counter of skipped records.
        block_tokens: tokens per hash id. Mooncake: default 512. kvsim CSV/Parquet:
            used for records whose ``block_tokens`` is empty.

    Raises:
        InputError: bad arguments or an unusable file (at the call); a bad record
            (``key="line N"``, when the stream reaches it).
        ValueError: ``skip_bad`` without ``bad``.
    """
    source = str(path)
    p = Path(path)
    if skip_bad and bad is None:
        raise ValueError("skip_bad=True needs a BadLines to count the skipped records in")
    if block_tokens is not None and (type(block_tokens) is not int or block_tokens < 1):
        raise InputError(source, "--block-tokens", f"{block_tokens!r}", "an integer >= 1")
    if fmt is None:
        fmt = detect_format(p)
    else:
        _head(p, source)  # missing / unreadable: fail now, not at the first next()
    if fmt == "mooncake":
        return _iter_mooncake(p, source, skip_bad, bad, block_tokens or MOONCAKE_BLOCK_TOKENS)
    if fmt == "azure":
        return _iter_azure(p, source, skip_bad, bad)
    if fmt == "csv":
        return _iter_csv(p, source, skip_bad, bad, block_tokens)
    if fmt == "parquet":
        return _iter_parquet(p, source, skip_bad, bad, block_tokens)
    raise InputError(source, "--format", f"{fmt!r}", "|".join(FORMATS))


_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _bad(source: str, n: int, problem: str, allowed: str) -> InputError:
    return InputError(source, f"line {n}", problem, allowed)


def _check_mooncake_line(source: str, n: int, rec: Any, block_tokens: int,
                  prev_ts: float) -> tuple[float, int, int, list[int]]:
    """Validate one parsed line; return (timestamp, input, output, hash_ids)."""
    if not isinstance(rec, dict):
        raise _bad(source, n, f"not a JSON object: {type(rec).__name__}", "one JSON object per line")
    for key in _FIELDS:
        if key not in rec:
            raise _bad(source, n, f"missing field {key!r}", "objects with " + ", ".join(_FIELDS))
    ts, inp, out, ids = rec["timestamp"], rec["input_length"], rec["output_length"], rec["hash_ids"]
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        raise _bad(source, n, f"timestamp {ts!r}", "a finite number of milliseconds >= 0")
    if ts < prev_ts:
        raise _bad(source, n, f"timestamp {ts!r} is smaller than the previous line's {prev_ts!r}",
                   "non-decreasing timestamps")
    for key, value in (("input_length", inp), ("output_length", out)):
        if type(value) is not int or value <= 0:
            raise _bad(source, n, f"{key} {value!r}", "an integer >= 1")
    if type(ids) is not list or not all(type(h) is int and h >= 0 for h in ids):
        raise _bad(source, n, "hash_ids is not a list of non-negative integers",
                   "a list of non-negative integers")
    want = -(-inp // block_tokens)
    if len(ids) != want:
        raise _bad(source, n, f"{len(ids)} hash_ids for input_length {inp}",
                   f"ceil(input_length / {block_tokens}) = {want} ids")
    return float(ts), inp, out, ids



def iter_mooncake_records(path: str | os.PathLike[str], block_tokens: int = MOONCAKE_BLOCK_TOKENS, *,
                          skip_bad: bool = False, bad: BadLines | None = None) -> Iterator[TraceRecord]:
    """The records of a Mooncake JSONL trace, read lazily: the file is opened at the
    first ``next()`` (a named pipe streams; nothing is read ahead)."""
    return _iter_mooncake(Path(path), str(path), skip_bad, bad, block_tokens)


def _iter_mooncake(path: Path, source: str, skip_bad: bool, bad: BadLines | None,
                   block_tokens: int) -> Iterator[TraceRecord]:
    prev = 0.0
    with _open_binary(path, source) as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                try:
                    obj = json.loads(raw)
                except UnicodeDecodeError:
                    raise InputError(source, f"line {n}", "not UTF-8 text",
                                     "one JSON object per line") from None
                except json.JSONDecodeError as exc:
                    raise InputError(source, f"line {n}", f"invalid JSON ({exc.msg} at column {exc.colno})",
                                     "one JSON object per line") from None
                ts, inp, out, ids = _check_mooncake_line(source, n, obj, block_tokens, prev)
                try:
                    session = _session(obj.get("session_id"))
                except _FieldError as exc:
                    raise InputError(source, f"line {n}", exc.problem, exc.allowed) from None
            except InputError as exc:
                _skip(exc, skip_bad, bad)
                continue
            prev = ts
            yield TraceRecord(n, ts / 1000.0, inp, out, tuple(ids), block_tokens, None, None, session)


class _Lines:
    """Decoded lines of a binary file for ``csv.reader``; remembers undecodable lines."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.n = 0
        self.undecodable = 0

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        raw = next(self.f)
        self.n += 1
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", "replace")
            self.undecodable = self.undecodable or self.n
        if self.n == 1:
            text = text.removeprefix("\ufeff")
        return text


def _csv_rows(f: IO[bytes]) -> Iterator[tuple[int, list[str] | _FieldError]]:
    """(first line of the record, its fields or the problem) for every non-blank CSV record."""
    lines = _Lines(f)
    reader = csv.reader(lines)
    end = 0
    while True:
        start = end + 1
        try:
            row: list[str] | _FieldError = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            row = _FieldError(f"unreadable CSV ({exc})", "comma-separated fields, double-quoted where needed")
        end = reader.line_num
        if lines.undecodable:
            row = _FieldError("not UTF-8 text", "UTF-8 text")
            lines.undecodable = 0
        if isinstance(row, list) and not any(c.strip() for c in row):
            continue
        yield start, row


def _iter_csv(path: Path, source: str, skip_bad: bool, bad: BadLines | None,
              block_tokens: int | None) -> Iterator[TraceRecord]:
    allowed_header = "a header naming " + ", ".join(CSV_REQUIRED) + " and optionally " + \
        ", ".join(CSV_COLUMNS[3:])
    checker = _Checker(block_tokens)
    with _open_binary(path, source) as f:
        rows = _csv_rows(f)
        first = next(rows, None)
        if first is None:
            raise InputError(source, "line 1", "empty file, no header", allowed_header)
        hline, header = first
        if isinstance(header, _FieldError):
            raise InputError(source, f"line {hline}", header.problem, header.allowed)
        names = [h.strip() for h in header]
        if tuple(names) == AZURE_HEADER:
            raise InputError(source, f"line {hline}", "this is an Azure trace header", "--format azure")
        unknown = [h for h in names if h not in CSV_COLUMNS]
        dupes = sorted({h for h in names if names.count(h) > 1})
        missing = [h for h in CSV_REQUIRED if h not in names]
        if unknown or dupes or missing:
            what = "; ".join(part for part in (
                f"unknown column(s) {', '.join(map(repr, unknown))}" if unknown else "",
                f"duplicate column(s) {', '.join(map(repr, dupes))}" if dupes else "",
                f"missing column(s) {', '.join(missing)}" if missing else "") if part)
            raise InputError(source, f"line {hline}", what, allowed_header)
        for n, row in rows:
            try:
                if isinstance(row, _FieldError):
                    raise row
                if len(row) != len(names):
                    raise _FieldError(f"{len(row)} fields, expected {len(names)}",
                                      f"{len(names)} fields as in the header")
                rec = checker.record(n, dict(zip(names, row, strict=True)))
            except _FieldError as exc:
                _skip(InputError(source, f"line {n}", exc.problem, exc.allowed), skip_bad, bad)
                continue
            yield rec


def _azure_ns(text: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.f...]`` (up to 9 fractional digits) -> integer ns since 1970."""
    t = text.strip()
    base, dot, frac = t.partition(".")
    try:
        dt = datetime.strptime(base, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise _FieldError(f"TIMESTAMP {text!r}", "YYYY-MM-DD HH:MM:SS[.fffffff]") from None
    ns = 0
    if dot:
        if not (frac.isascii() and frac.isdigit() and len(frac) <= 9):
            raise _FieldError(f"TIMESTAMP {text!r}",
                              "YYYY-MM-DD HH:MM:SS[.fffffff] (at most 9 fractional digits)")
        ns = int(frac.ljust(9, "0"))
    return ((dt - _EPOCH) // _SECOND) * 1_000_000_000 + ns


def _iter_azure(path: Path, source: str, skip_bad: bool, bad: BadLines | None) -> Iterator[TraceRecord]:
    first_ns: int | None = None
    prev_ns = -(1 << 62)
    with _open_binary(path, source) as f:
        rows = _csv_rows(f)
        first = next(rows, None)
        if first is None:
            raise InputError(source, "line 1", "empty file, no header", ",".join(AZURE_HEADER))
        hline, header = first
        if isinstance(header, _FieldError) or tuple(h.strip() for h in header) != AZURE_HEADER:
            shown = header.problem if isinstance(header, _FieldError) else f"header {','.join(header)!r}"
            raise InputError(source, f"line {hline}", shown, ",".join(AZURE_HEADER))
        for n, row in rows:
            try:
                if isinstance(row, _FieldError):
                    raise row
                if len(row) != 3:
                    raise _FieldError(f"{len(row)} fields, expected 3", ",".join(AZURE_HEADER))
                ns = _azure_ns(row[0])
                if ns < prev_ns:
                    raise _FieldError(f"TIMESTAMP {row[0].strip()!r} is earlier than the previous record's",
                                      "non-decreasing timestamps")
                inp = _req_int(row[1], "ContextTokens", 1)
                out = _req_int(row[2], "GeneratedTokens", 1)
            except _FieldError as exc:
                _skip(InputError(source, f"line {n}", exc.problem, exc.allowed), skip_bad, bad)
                continue
            prev_ns = ns
            if first_ns is None:
                first_ns = ns
            yield TraceRecord(n, (ns - first_ns) / 1e9, inp, out, None, None, None, None, None)


def _iter_parquet(path: Path, source: str, skip_bad: bool, bad: BadLines | None,
                  block_tokens: int | None) -> Iterator[TraceRecord]:
    allowed = "kvsim's trace schema: " + ", ".join(CSV_COLUMNS) + " (the first three required)"
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(source, "", f"not a readable Parquet file ({exc})", "a Parquet file") from exc
    names = list(pf.schema_arrow.names)
    unknown = [h for h in names if h not in CSV_COLUMNS]
    missing = [h for h in CSV_REQUIRED if h not in names]
    if unknown or missing:
        what = "; ".join(part for part in (
            f"unknown column(s) {', '.join(map(repr, unknown))}" if unknown else "",
            f"missing column(s) {', '.join(missing)}" if missing else "") if part)
        raise InputError(source, "schema", what, allowed)
    checker = _Checker(block_tokens)
    n = 0
    with pf:
        try:
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=names):
                columns = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
                for values in zip(*columns, strict=True):
                    n += 1
                    try:
                        rec = checker.record(n, dict(zip(names, values, strict=True)))
                    except _FieldError as exc:
                        _skip(InputError(source, f"line {n}", exc.problem, exc.allowed), skip_bad, bad)
                        continue
                    yield rec
        except (pa.ArrowException, OSError) as exc:
            raise InputError(source, f"line {n + 1}", f"unreadable Parquet data ({exc})",
                             "a Parquet file") from exc


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------

def _percentile(values: list[int] | list[float] | array[int], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of sorted ``values``."""
    pos = q * (len(values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _summary(values: array[int]) -> dict[str, float]:
    s = sorted(values)
    return {"mean": sum(s) / len(s), "p50": _percentile(s, 0.50), "p99": _percentile(s, 0.99),
            "max": float(s[-1])}


def _spread(values: array[int] | array[float]) -> dict[str, float] | None:
    """p50, p90 and max of ``values`` (``None`` when empty)."""
    if not values:
        return None
    s = sorted(values)
    return {"p50": float(_percentile(s, 0.50)), "p90": float(_percentile(s, 0.90)), "max": float(s[-1])}


class _Moments:
    """Streaming mean and population standard deviation (Welford)."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    def cv(self) -> float | None:
        """Standard deviation over mean (population, ddof 0); ``None`` without a positive mean."""
        if self.n == 0 or self.mean <= 0:
            return None
        return math.sqrt(max(self.m2, 0.0) / self.n) / self.mean


class _Bursts:
    """Arrival-time burstiness of a non-decreasing stream of timestamps, in O(1) memory."""

    def __init__(self) -> None:
        self.n = 0
        self.prev = 0.0
        self.run = 0                   # requests at the current timestamp
        self.distinct = 0
        self.largest = 0
        self.largest_at = 0.0
        self.together = 0              # requests sharing their timestamp with another
        self.gaps = _Moments()         # every consecutive pair (zeros included)
        self.distinct_gaps = _Moments()

    def _close(self) -> None:
        if self.run > self.largest:
            self.largest, self.largest_at = self.run, self.prev
        if self.run > 1:
            self.together += self.run

    def add(self, t: float) -> None:
        if self.n:
            self.gaps.add(t - self.prev)
        if self.n and t == self.prev:
            self.run += 1
        else:
            if self.n:
                self._close()
                self.distinct_gaps.add(t - self.prev)
            self.distinct += 1
            self.run = 1
        self.n += 1
        self.prev = t

    def result(self) -> dict[str, Any]:
        self._close()
        self.run = 0
        return {"distinct_times": self.distinct, "largest_burst": self.largest,
                "largest_burst_at_s": self.largest_at, "simultaneous_ratio": self.together / self.n,
                "mean_interarrival_s": self.gaps.mean if self.gaps.n else None,
                "interarrival_cv": self.gaps.cv(), "interarrival_cv_distinct": self.distinct_gaps.cv()}


def trace_stats(path: str | os.PathLike[str], fmt: str | None = None, *, skip_bad: bool = False,
                block_tokens: int | None = None) -> dict[str, Any]:
    """Summary statistics of a trace, in one streaming pass.

    Keys: ``path``, ``format``, ``requests``, ``bad_lines`` (``count``,
    ``examples``), ``first_arrival_s``, ``last_arrival_s``, ``duration_s``
    (last - first), ``rate_per_s`` (requests / duration; ``None`` for a zero
    duration), ``input_tokens`` and ``output_tokens`` (``mean``, ``p50``,
    ``p99``, ``max``; linear-interpolation percentiles). ``hash_ids`` (when
    records carry them, else ``None``): ``requests``, ``block_tokens`` (a list
    of the sizes seen), ``block_refs``, ``unique_blocks``, ``reuse_ratio``
    (fraction of block references to an id seen earlier in the trace),
    ``prefix_hit_token_ratio`` (input tokens inside the leading run of
    already-seen blocks, over all input tokens of those records: an infinite
    prefix cache), ``requests_reusing_ratio``, ``blocks_per_request`` and
    ``reused_prefix_blocks`` (summaries), ``reused_refs`` (references to an id
    seen earlier) and, over those references, ``reuse_distance_requests`` and
    ``reuse_distance_s`` (``p50``, ``p90``, ``max``; ``None`` without reuse):
    how many requests later, and how many seconds later, an id is referenced
    again after its previous reference (the time a cache must hold a block for
    that reference to hit). ``arrivals`` (burstiness): ``distinct_times``,
    ``largest_burst`` (most requests at one timestamp) and
    ``largest_burst_at_s`` (its first time), ``simultaneous_ratio`` (requests
    sharing their timestamp with at least one other), ``mean_interarrival_s``,
    ``interarrival_cv`` (standard deviation over mean of the gaps between
    consecutive requests, zeros included; population deviation) and
    ``interarrival_cv_distinct`` (the same over consecutive distinct
    timestamps); a CV is ``None`` without a positive mean gap. ``prefix_groups`` (kvsim traces with
    prefix groups, else ``None``): ``requests``, ``groups``,
    ``reuse_token_ratio`` (prefix tokens of groups seen earlier over those
    records' input tokens).

    Raises:
        InputError: as :func:`iter_records`, or no valid record at all.
    """
    bad = BadLines()
    fmt = fmt or detect_format(path)
    inputs: array[int] = array("q")
    outputs: array[int] = array("q")
    first = last = 0.0
    bursts = _Bursts()
    # hash id -> index of the last request that referenced it; arrival time by request index
    last_use: dict[int, int] = {}
    times: array[float] = array("d")
    dist_req: array[int] = array("q")
    dist_s: array[float] = array("d")
    sizes: set[int] = set()
    blocks: array[int] = array("q")
    reused_prefix: array[int] = array("q")
    refs = reused = hit_tokens = hashed_input = reusing = 0
    groups: set[int] = set()
    grouped = grouped_input = group_hits = 0
    for rec in iter_records(path, fmt, skip_bad=skip_bad, bad=bad, block_tokens=block_tokens):
        if not inputs:
            first = rec.arrival_s
        last = rec.arrival_s
        index = len(inputs)
        bursts.add(rec.arrival_s)
        times.append(rec.arrival_s)
        inputs.append(rec.input_tokens)
        outputs.append(rec.output_tokens)
        if rec.hash_ids is not None and rec.block_tokens is not None:
            lead = r = 0
            in_prefix = True
            for h in rec.hash_ids:
                prev = last_use.get(h)
                last_use[h] = index
                if prev is not None:
                    r += 1
                    dist_req.append(index - prev)
                    dist_s.append(rec.arrival_s - times[prev])
                    if in_prefix:
                        lead += 1
                else:
                    in_prefix = False
            refs += len(rec.hash_ids)
            reused += r
            reusing += r > 0
            hit_tokens += min(lead * rec.block_tokens, rec.input_tokens)
            hashed_input += rec.input_tokens
            sizes.add(rec.block_tokens)
            blocks.append(len(rec.hash_ids))
            reused_prefix.append(lead)
        if rec.prefix_group is not None and rec.prefix_tokens is not None:
            grouped += 1
            grouped_input += rec.input_tokens
            if rec.prefix_group in groups:
                group_hits += rec.prefix_tokens
            else:
                groups.add(rec.prefix_group)
    if not inputs:
        raise no_requests(str(path), bad)
    duration = last - first
    hashed: dict[str, Any] | None = None
    if blocks:
        hashed = {
            "requests": len(blocks),
            "block_tokens": sorted(sizes),
            "block_refs": refs,
            "unique_blocks": len(last_use),
            "reuse_ratio": reused / refs if refs else 0.0,
            "prefix_hit_token_ratio": hit_tokens / hashed_input,
            "requests_reusing_ratio": reusing / len(blocks),
            "blocks_per_request": _summary(blocks),
            "reused_prefix_blocks": _summary(reused_prefix),
            "reused_refs": reused,
            "reuse_distance_requests": _spread(dist_req),
            "reuse_distance_s": _spread(dist_s),
        }
    grouped_stats: dict[str, Any] | None = None
    if grouped:
        grouped_stats = {"requests": grouped, "groups": len(groups),
                         "reuse_token_ratio": group_hits / grouped_input}
    return {
        "path": str(path),
        "format": fmt,
        "requests": len(inputs),
        "bad_lines": {"count": bad.count, "examples": list(bad.examples)},
        "first_arrival_s": first,
        "last_arrival_s": last,
        "duration_s": duration,
        "rate_per_s": len(inputs) / duration if duration > 0 else None,
        "arrivals": bursts.result(),
        "input_tokens": _summary(inputs),
        "output_tokens": _summary(outputs),
        "hash_ids": hashed,
        "prefix_groups": grouped_stats,
    }


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _burst_rows(a: dict[str, Any], requests: int) -> list[tuple[str, str]]:
    """The burstiness lines of :func:`format_stats`."""
    def cv(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    gap = a["mean_interarrival_s"]
    return [
        ("arrival times", f"{a['distinct_times']:,} distinct for {requests:,} requests "
                          f"(mean {requests / a['distinct_times']:.2f} per time)"),
        ("largest burst", f"{a['largest_burst']:,} requests at {a['largest_burst_at_s']:,.3f} s"),
        ("simultaneous", f"{a['simultaneous_ratio']:.1%} of requests share their arrival time"),
        ("inter-arrival CV", f"{cv(a['interarrival_cv'])} over all gaps (zeros included), "
                             f"{cv(a['interarrival_cv_distinct'])} over distinct times"
                             + ("" if gap is None else f"; mean gap {gap:,.3f} s")),
    ]


def format_stats(stats: dict[str, Any]) -> str:
    """``trace_stats`` as an aligned text table."""
    rows: list[tuple[str, str]] = [
        ("trace", f"{stats['path']} ({stats['format']})"),
        ("requests", f"{stats['requests']:,}"),
        ("duration", f"{stats['duration_s']:,.1f} s (arrivals {stats['first_arrival_s']:,.3f} .. "
                     f"{stats['last_arrival_s']:,.3f} s)"),
        ("rate", "-" if stats["rate_per_s"] is None else f"{stats['rate_per_s']:.2f} req/s"),
        *_burst_rows(stats["arrivals"], stats["requests"]),
    ]
    dists: list[tuple[str, dict[str, float]]] = [
        ("input tokens", stats["input_tokens"]), ("output tokens", stats["output_tokens"])]
    h = stats["hash_ids"]
    if h is not None:
        dists += [("blocks per request", h["blocks_per_request"]),
                  ("reused prefix blocks", h["reused_prefix_blocks"])]
    out_rows: list[tuple[str, str]] = list(rows)
    if h is not None:
        partial = "" if h["requests"] == stats["requests"] else f" ({h['requests']:,} requests with hash_ids)"
        out_rows += [
            ("block size", ", ".join(f"{b:,}" for b in h["block_tokens"]) + " tokens" + partial),
            ("block refs / unique", f"{h['block_refs']:,} / {h['unique_blocks']:,}"),
            ("prefix reuse", f"{h['reuse_ratio']:.3f} of block references seen earlier"),
            ("prefix-hit tokens", f"{h['prefix_hit_token_ratio']:.3f} of input tokens (infinite cache)"),
            ("requests reusing", f"{h['requests_reusing_ratio']:.1%} of requests reuse >= 1 block"),
        ]
        dr, ds = h["reuse_distance_requests"], h["reuse_distance_s"]
        if dr is not None and ds is not None:
            by_req = f"p50 {_fmt(dr['p50'])} / p90 {_fmt(dr['p90'])} / max {_fmt(dr['max'])} requests"
            by_s = f"p50 {ds['p50']:,.2f} / p90 {ds['p90']:,.2f} / max {ds['max']:,.2f} s"
            out_rows.append(("reuse distance", f"{by_req}; {by_s} since the block's previous use"))
    g = stats["prefix_groups"]
    if g is not None:
        out_rows += [
            ("prefix groups", f"{g['groups']:,} over {g['requests']:,} requests"),
            ("prefix reuse", f"{g['reuse_token_ratio']:.3f} of input tokens in a group prefix seen earlier"),
        ]
    b = stats["bad_lines"]
    if b["count"]:
        out_rows.append(("bad lines skipped", f"{b['count']:,}"))
        out_rows += [("", e) for e in b["examples"]]
        if b["count"] > len(b["examples"]):
            out_rows.append(("", "..."))
    width = max(len(k) for k, _ in out_rows)
    lines = [f"{k:<{width}}  {v}".rstrip() for k, v in out_rows]
    cells = [[name, *(_fmt(d[c]) if c != "mean" else f"{d[c]:,.1f}" for c in ("mean", "p50", "p99", "max"))]
             for name, d in dists]
    head = ["", "mean", "p50", "p99", "max"]
    widths = [max(len(r[i]) for r in [head, *cells]) for i in range(5)]
    lines.append("")
    for r in [head, *cells]:
        cols = [r[0].ljust(widths[0]), *(r[i].rjust(widths[i]) for i in range(1, 5))]
        lines.append("  ".join(cols).rstrip())
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Writing and conversion
# ----------------------------------------------------------------------------------------------

@contextmanager
def _atomic_path(path: Path, source: str | None = None) -> Iterator[Path]:
    """A fresh temporary path next to ``path``; renamed onto it if the block succeeds, else removed."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.part"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise InputError(source or str(path), "", f"cannot write ({exc.strerror or exc})",
                         "a path in an existing, writable folder") from exc
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def _ms(arrival_s: float) -> int | float:
    ms = arrival_s * 1000.0
    r = round(ms)
    return r if abs(ms - r) <= 1e-9 * max(1.0, abs(ms)) else ms


def _write_mooncake(records: Iterable[TraceRecord], f: IO[str], source: str) -> tuple[int, int | None]:
    n = 0
    size: int | None = None
    for rec in records:
        if rec.hash_ids is None or rec.block_tokens is None:
            raise InputError(source, f"line {rec.line}", "no hash_ids",
                             "records with hash_ids for Mooncake output (write csv or parquet instead)")
        if size is None:
            size = rec.block_tokens
        elif rec.block_tokens != size:
            raise InputError(source, f"line {rec.line}",
                             f"block_tokens {rec.block_tokens} differs from the first record's {size}",
                             "one block size per Mooncake file")
        obj: dict[str, Any] = {"timestamp": _ms(rec.arrival_s), "input_length": rec.input_tokens,
                               "output_length": rec.output_tokens, "hash_ids": list(rec.hash_ids)}
        if rec.session_id is not None:
            obj["session_id"] = rec.session_id
        f.write(json.dumps(obj))
        f.write("\n")
        n += 1
    return n, size


def _cell(v: object) -> str:
    return "" if v is None else str(v)


def _write_csv(records: Iterable[TraceRecord], f: IO[str]) -> int:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    n = 0
    for r in records:
        w.writerow((repr(r.arrival_s), r.input_tokens, r.output_tokens,
                    "" if r.hash_ids is None else " ".join(map(str, r.hash_ids)),
                    _cell(r.block_tokens), _cell(r.prefix_group), _cell(r.prefix_tokens),
                    _cell(r.session_id)))
        n += 1
    return n


def _write_parquet(records: Iterable[TraceRecord], path: Path, source: str) -> int:
    schema = pa.schema([
        ("arrival_s", pa.float64()), ("input_tokens", pa.int64()), ("output_tokens", pa.int64()),
        ("hash_ids", pa.list_(pa.int64())), ("block_tokens", pa.int64()), ("prefix_group", pa.int64()),
        ("prefix_tokens", pa.int64()), ("session_id", pa.string())])
    cols: dict[str, list[Any]] = {name: [] for name in CSV_COLUMNS}
    n = 0

    def flush(writer: Any) -> None:
        writer.write_batch(pa.RecordBatch.from_pydict(cols, schema=schema))
        for v in cols.values():
            v.clear()

    with pq.ParquetWriter(path, schema) as writer:
        for r in records:
            too_big = [v for v in (r.input_tokens, r.output_tokens, r.prefix_group, r.prefix_tokens,
                                   max(r.hash_ids, default=0) if r.hash_ids else 0) if v and v > _INT64_MAX]
            if too_big:
                raise InputError(source, f"line {r.line}", f"value {too_big[0]} does not fit in int64",
                                 "integers < 2**63 for Parquet output")
            for name in CSV_COLUMNS:
                cols[name].append(getattr(r, name))
            if r.hash_ids is not None:
                cols["hash_ids"][-1] = list(r.hash_ids)
            n += 1
            if len(cols["arrival_s"]) >= _PARQUET_BATCH:
                flush(writer)
        if cols["arrival_s"] or n == 0:
            flush(writer)
    return n


def write_records(records: Iterable[TraceRecord], path: str | os.PathLike[str], fmt: str, *,
                  source: str = "input", overwrite: bool = False,
                  bad: BadLines | None = None) -> tuple[int, int | None]:
    """Write ``records`` to ``path`` in ``fmt`` (one of :data:`WRITABLE_FORMATS`), atomically.

    Returns ``(records written, block_tokens of a Mooncake file or None)``.
    ``source`` names the input in errors about a record; ``bad``, the lines
    the reader skipped (for the error when none was left). No record is bad
    input (:func:`no_requests`). On any error the target is left as it was.
    """
    p = Path(path)
    if fmt not in WRITABLE_FORMATS:
        raise InputError(str(path), "--to", f"{fmt!r}", "|".join(WRITABLE_FORMATS))
    if p.exists() and not overwrite:
        raise InputError(str(path), "", "already exists", "a new path, or --force to replace it")
    if p.is_dir():
        raise InputError(str(path), "", "is a directory", "a file path")
    with _atomic_path(p) as tmp:
        block_tokens: int | None = None
        if fmt == "parquet":
            n = _write_parquet(records, tmp, source)
        else:
            with tmp.open("w", encoding="utf-8", newline="") as f:
                n, block_tokens = (_write_csv(records, f), None) if fmt == "csv" else \
                    _write_mooncake(records, f, source)
        if n == 0:   # an empty trace is refused here as everywhere else (stats, run): nothing is written
            raise no_requests(source, bad)
    return n, block_tokens


def no_requests(source: str, bad: BadLines | str | None = None, *,
                skip_option: str = "--skip-bad") -> InputError:
    """``FILE: no requests (why)``: an empty trace is bad input (a run, the statistics, a
    conversion), never an "ok" run of 0 requests. ``bad``: the lines ``skip_option``
    skipped (all of them, then), or the reason in words."""
    if isinstance(bad, str):
        why = bad
    elif bad is not None and bad.count:
        why = (f"every line was bad: {bad.count} bad line{'s' if bad.count != 1 else ''} "
               f"skipped by {skip_option}")
    else:
        why = "the file has no request line"
    return InputError(source, "", f"no requests ({why})", "a trace with at least one request")


def convert_trace(src: str | os.PathLike[str], dst: str | os.PathLike[str], src_fmt: str | None = None,
                  dst_fmt: str | None = None, *, skip_bad: bool = False, bad: BadLines | None = None,
                  block_tokens: int | None = None, overwrite: bool = False) -> tuple[int, int | None]:
    """Stream ``src`` into ``dst`` (atomically); returns what :func:`write_records` returns."""
    if skip_bad and bad is None:
        bad = BadLines()
    fmt = src_fmt or detect_format(src)
    out_fmt = dst_fmt or output_format(dst)
    records = iter_records(src, fmt, skip_bad=skip_bad, bad=bad, block_tokens=block_tokens)
    return write_records(records, dst, out_fmt, source=str(src), overwrite=overwrite, bad=bad)


# ----------------------------------------------------------------------------------------------
# Download
# ----------------------------------------------------------------------------------------------

_MOONCAKE_RAW = ("https://raw.githubusercontent.com/kvcache-ai/Mooncake/"
                 "3b5a594133958449a1feaf1c9e0fc1b553e34a28/FAST25-release/traces/")
_AZURE_RAW = ("https://raw.githubusercontent.com/Azure/AzurePublicDataset/"
              "b469a113cedca53ddc3bdea71a143dc4b7d8700c/data/")


@dataclass(frozen=True, slots=True)
class KnownTrace:
    """A published trace :func:`fetch_trace` can download (digests as published, where known)."""

    name: str
    filename: str
    url: str
    sha256: str | None
    git_blob: str | None
    license: str


KNOWN_TRACES: dict[str, KnownTrace] = {t.name: t for t in (
    KnownTrace("mooncake-conversation", "conversation_trace.jsonl",
               _MOONCAKE_RAW + "conversation_trace.jsonl",
               "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
               "5a371794b81d7fc7487ec8a02a2c631bcc7fbdf8", "Apache-2.0"),
    KnownTrace("mooncake-toolagent", "toolagent_trace.jsonl", _MOONCAKE_RAW + "toolagent_trace.jsonl",
               None, "b765599d1e0828b37f68d481563c385d3c11de54", "Apache-2.0"),
    KnownTrace("mooncake-synthetic", "synthetic_trace.jsonl", _MOONCAKE_RAW + "synthetic_trace.jsonl",
               "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
               "e4838049c0dcfc358a5f24ab08251279475cba94", "Apache-2.0"),
    KnownTrace("azure-conv-2023", "AzureLLMInferenceTrace_conv.csv",
               _AZURE_RAW + "AzureLLMInferenceTrace_conv.csv",
               "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
               "5b9219f2caf93bbbf95ec29894e206115658e235", "CC-BY-4.0"),
    KnownTrace("azure-code-2023", "AzureLLMInferenceTrace_code.csv",
               _AZURE_RAW + "AzureLLMInferenceTrace_code.csv",
               "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
               "62bd8109d0f2b1bc48206d397ecca48d8de03aab", "CC-BY-4.0"),
)}


def default_cache_dir() -> Path:
    """``$KVSIM_CACHE`` if set (the folder the traces go in), else ``~/.cache/kvsim/traces``."""
    env = os.environ.get("KVSIM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvsim" / "traces"


#: environment variable naming a folder of trace files, searched before the fetch cache
TRACES_ENV = "KVSIM_TRACES"


def trace_search_dirs() -> list[Path]:
    """Where a trace named in a scenario is looked for, in order: ``$KVSIM_TRACES``
    (when set), then the fetch cache (:func:`default_cache_dir`)."""
    env = os.environ.get(TRACES_ENV)
    return [Path(env), default_cache_dir()] if env else [default_cache_dir()]


def resolve_trace(name: str, *, source: str = "trace", key: str = "") -> Path:
    """The file of a known trace (``KNOWN_TRACES``), by name.

    Each folder of :func:`trace_search_dirs` is tried in order, for the file name
    ``kvsim trace fetch`` saves under (``conversation_trace.jsonl``), then the same
    name with ``.gz`` (a compressed copy). No digest is checked here: the fetch
    checks what it downloads, and a run records the content's digest
    (:func:`trace_digest`).

    Raises:
        InputError: an unknown name, or no folder holds the file (one line,
            naming the ``kvsim trace fetch`` command that gets it).
    """
    spec = KNOWN_TRACES.get(name)
    if spec is None:
        raise InputError(source, key, f"unknown trace name {name!r}",
                         "one of " + ", ".join(KNOWN_TRACES) + " (kvsim trace fetch --help); "
                         "a trace file is named by workload.path instead")
    dirs = trace_search_dirs()
    for folder in dirs:
        for filename in (spec.filename, spec.filename + ".gz"):
            candidate = folder / filename
            if candidate.is_file():
                return candidate
    where = " and ".join(
        f"${TRACES_ENV} ({d})" if i == 0 and len(dirs) > 1 else f"the fetch cache ({d})"
        for i, d in enumerate(dirs))
    raise InputError(source, key, f"trace {name!r} not found: no {spec.filename} in {where}",
                     f"run `kvsim trace fetch {name}` first, or set ${TRACES_ENV} to a folder "
                     f"holding {spec.filename}")


_DIGESTS: dict[tuple[str, int, int], str] = {}


def trace_digest(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of a trace file's content, decompressed when gzip-compressed.

    A plain file and its gzip copy give the same digest; for a published trace it
    equals the published sha256. Remembered per (path, size, mtime) in this process.

    Raises:
        InputError: the file is missing, unreadable or corrupt gzip data.
    """
    p = Path(path)
    source = str(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise InputError(source, "", f"cannot read ({exc.strerror or exc})", "a readable trace file") from exc
    memo = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    known = _DIGESTS.get(memo)
    if known is not None:
        return known
    h = hashlib.sha256()
    with _open_binary(p, source) as f:
        read = getattr(f, "read", None)
        if read is not None:
            while chunk := read(1 << 20):
                h.update(chunk)
        else:
            for line in f:
                h.update(line)
    digest = h.hexdigest()
    _DIGESTS[memo] = digest
    return digest


def trace_has_requests(path: str | os.PathLike[str], fmt: str) -> bool:
    """False when a regular trace file holds no record line at all (empty, blank lines
    only, or a CSV header alone; a Parquet file of zero rows). Reads up to the first
    record line; anything else (a pipe, a missing file) counts as True here and is
    left to the reader.
    """
    p = Path(path)
    source = str(path)
    try:
        if not p.is_file():
            return True
        if fmt == "parquet":
            try:
                return bool(pq.ParquetFile(p).metadata.num_rows)
            except (pa.ArrowException, OSError):
                return True
        skip = 0 if fmt == "mooncake" else 1   # the CSV header
        with _open_binary(p, source) as f:
            for raw in f:
                if raw.strip():
                    if skip == 0:
                        return True
                    skip -= 1
        return False
    except InputError:
        return True


def _digest_problem(path: Path, spec: KnownTrace) -> str | None:
    """``None`` when the file matches the published digests, else what differs."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    blob = hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha256.update(chunk)
            blob.update(chunk)
    if spec.sha256 is not None and sha256.hexdigest() != spec.sha256:
        return f"sha256 mismatch: got {sha256.hexdigest()}, expected {spec.sha256}"
    if spec.git_blob is not None and blob.hexdigest() != spec.git_blob:
        return f"git blob id mismatch: got {blob.hexdigest()}, expected {spec.git_blob}"
    return None


def fetch_trace(name: str, cache_dir: str | os.PathLike[str] | None = None, *, url: str | None = None,
                force: bool = False, timeout_s: float = 60.0) -> tuple[Path, bool]:
    """Download a known trace into the cache folder; returns ``(path, downloaded)``.

    A copy in ``$KVSIM_TRACES`` (without ``cache_dir``) or in the cache that
    matches the published digests is reused (``downloaded`` False) unless
    ``force``. The download streams into a temporary file in the
    cache folder, is checked against the published sha256 and git blob id
    (whichever are known) and only then renamed into place.

    Raises:
        InputError: unknown name, unusable cache folder, a cached copy that does
            not match (use ``force``), or ``NAME: download failed (...)``.
    """
    spec = KNOWN_TRACES.get(name)
    if spec is None:
        raise InputError(name, "", "unknown trace name", ", ".join(KNOWN_TRACES))
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = folder / spec.filename
    env = os.environ.get(TRACES_ENV)
    local = Path(env) / spec.filename if env and cache_dir is None else None
    if local is not None and local.is_file() and not force and _digest_problem(local, spec) is None:
        return local, False     # $KVSIM_TRACES already holds a matching copy: nothing to download
    if target.is_file() and not force:
        problem = _digest_problem(target, spec)
        if problem is None:
            return target, False
        raise InputError(str(target), "", f"cached copy does not match ({problem})",
                         f"kvsim trace fetch {name} --force to download it again")
    # results imports scenario, which imports this module: its folder helpers are imported here
    from sim.io.results import make_folder, remove_created  # noqa: PLC0415

    try:
        created = make_folder(folder)   # removed again when the download fails: nothing half made
    except InputError as exc:
        raise InputError(str(folder), "", f"cannot create the cache folder ({exc.problem.split(': ')[-1]})",
                         "a writable folder (--cache-dir DIR or $KVSIM_CACHE)") from None
    try:
        _download(name, spec, src=url or spec.url, folder=folder, target=target, timeout_s=timeout_s)
    except BaseException:
        remove_created(created)
        raise
    return target, True


def _download(name: str, spec: KnownTrace, *, src: str, folder: Path, target: Path, timeout_s: float) -> None:
    """Stream ``src`` into a temporary file in ``folder``, check its digests, rename it onto ``target``."""
    allowed = (f"a reachable URL serving the published {spec.filename} (check the connection, pass "
               f"--url MIRROR, or copy the file into {folder})")
    with _atomic_path(target, str(folder)) as tmp:
        try:
            with urllib.request.urlopen(src, timeout=timeout_s) as resp, tmp.open("wb") as out:
                while chunk := resp.read(1 << 16):
                    out.write(chunk)
        except urllib.error.HTTPError as exc:
            exc.close()
            raise InputError(name, "", f"download failed (HTTP {exc.code} {exc.reason} from {src})",
                             allowed) from None
        except urllib.error.URLError as exc:
            raise InputError(name, "", f"download failed ({exc.reason} from {src})", allowed) from None
        except ValueError as exc:
            raise InputError(name, "--url", f"download failed ({exc})",
                             "an http://, https:// or file:// URL") from None
        except (OSError, HTTPException) as exc:
            raise InputError(name, "", f"download failed ({exc or type(exc).__name__} from {src})",
                             allowed) from None
        problem = _digest_problem(tmp, spec)
        if problem is not None:
            raise InputError(name, "", f"download failed ({problem}; from {src})", allowed)
