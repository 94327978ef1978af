"""The collector's write-ahead log: what was acknowledged survives a crash.

Every accepted request is appended here before its OK reply, as one record:

    u32 payload length | u32 CRC-32 of (lsn, signal, payload) | u64 lsn | u8 signal | payload

`lsn` (log sequence number) increases by one per record across restarts. A record is
written with a single `writev` on an unbuffered descriptor, so once `append` returns
the bytes are in the operating system's page cache: a `kill -9` of the collector does
not lose them. With `fsync: true` each append also waits for the disk (`fdatasync`),
which survives a machine crash too, at the cost of one disk flush per request.

The log is cut into segments named after their first lsn. When the store has
committed every record of a segment (the store records the committed lsn in the same
transaction as the data), the segment is deleted. On start the log is scanned; a
record torn by a crash at the tail of the last segment is truncated away and one of
any other corrupt record ends its segment's replay, both logged and counted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flare.collector.errors import ConfigError, StartError

log = logging.getLogger(__name__)

SIGNAL_TRACES = 1
SIGNAL_METRICS = 2

_HEADER = struct.Struct("<IIQB")
_CRC_PREFIX = struct.Struct("<QB")
_SUFFIX = ".wal"


class WalFull(Exception):
    """Appending would take the log past its disk budget."""


@dataclass
class Record:
    lsn: int
    signal: int
    payload: bytes


@dataclass
class _Segment:
    path: Path
    first_lsn: int
    last_lsn: int  # first_lsn - 1 while empty
    size: int


def _crc(lsn: int, signal: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(_CRC_PREFIX.pack(lsn, signal)))


def _scan(path: Path) -> tuple[list[tuple[int, int, int, int]], int, bool]:
    return _scan_bytes(path.read_bytes())


class WriteAheadLog:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        fsync: bool = False,
        max_bytes: int = 1 << 30,
        segment_bytes: int = 64 << 20,
    ) -> None:
        self.directory = Path(directory)
        self.fsync = fsync
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []
        self._fd: int | None = None  # open descriptor of the last segment, if writable
        self._next_lsn = 1
        self._committed_lsn = 0
        self.corrupt_records = 0  # records skipped because their bytes were damaged
        self.identity = ""  # random id of this log, part of the store's marker key
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------ start-up
    def load_identity(self) -> str:
        """This log's id, created on first use; a new directory gets a new id.

        The store keys its committed position by this id, so a log that was deleted
        and started afresh (positions from 1 again) is never mistaken for the old one.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / "ID"
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                tmp.write_text(uuid.uuid4().hex + "\n")
                os.replace(tmp, path)
            self.identity = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot use WAL directory {self.directory}: {exc.strerror}")
        if not self.identity:
            raise ConfigError(f"WAL directory {self.directory} has an empty ID file; remove it")
        return self.identity

    def open(self, committed_lsn: int) -> None:
        """Scan existing segments; new records continue after everything seen."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create WAL directory {self.directory}: {exc.strerror}")
        self._lock_directory()
        self._committed_lsn = committed_lsn
        paths = sorted(self.directory.glob("*" + _SUFFIX))
        last_seen = committed_lsn
        for index, path in enumerate(paths):
            try:
                first_lsn = int(path.stem)
            except ValueError:
                log.warning("ignoring %s: not a WAL segment name", path)
                continue
            entries, good_bytes, clean = _scan(path)
            if not clean:
                self.corrupt_records += 1
                if index == len(paths) - 1:
                    log.warning("WAL %s: truncating a torn record at byte %d", path, good_bytes)
                    os.truncate(path, good_bytes)
                else:
                    log.warning("WAL %s: corrupt record at byte %d; later records of this segment are skipped", path, good_bytes)
            last_lsn = entries[-1][0] if entries else first_lsn - 1
            last_seen = max(last_seen, last_lsn)
            self._segments.append(_Segment(path, first_lsn, last_lsn, good_bytes))
        self._next_lsn = last_seen + 1
        self._delete_committed()

    def replay(self, after_lsn: int) -> Iterator[Record]:
        """Yield the records with lsn > `after_lsn`, oldest first."""
        for segment in list(self._segments):
            if segment.last_lsn <= after_lsn:
                continue
            data = segment.path.read_bytes()[: segment.size]
            entries, _, _ = _scan_bytes(data)
            for lsn, signal, start, length in entries:
                if lsn > after_lsn:
                    yield Record(lsn, signal, data[start : start + length])

    # ------------------------------------------------------------------ running
    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    @property
    def last_lsn(self) -> int:
        return self._next_lsn - 1

    @property
    def committed_lsn(self) -> int:
        return self._committed_lsn

    def append(self, signal: int, payload: bytes) -> int:
        """Persist one record to the OS (and disk with fsync); return its lsn."""
        with self._lock:
            need = _HEADER.size + len(payload)
            if self.size_bytes + need > self.max_bytes:
                raise WalFull(
                    f"write-ahead log {self.directory} is at its {self.max_bytes} byte budget"
                )
            if self._fd is None or self._segments[-1].size >= self.segment_bytes:
                self._start_segment()
            lsn = self._next_lsn
            header = _HEADER.pack(len(payload), _crc(lsn, signal, payload), lsn, signal)
            _write_all(self._fd, header, payload)
            if self.fsync:
                os.fdatasync(self._fd)
            segment = self._segments[-1]
            segment.size += need
            segment.last_lsn = lsn
            self._next_lsn = lsn + 1
            return lsn

    def commit(self, lsn: int) -> None:
        """Everything up to `lsn` is durable downstream: free the segments it covers."""
        with self._lock:
            self._committed_lsn = max(self._committed_lsn, lsn)
            self._delete_committed()

    def close(self) -> None:
        with self._lock:
            self._close_fd()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    def _lock_directory(self) -> None:
        """One collector per log: a second one would replay and free the first's records."""
        fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StartError(
                f"write-ahead log {self.directory} is in use by another collector "
                "(give each collector its own store and flare_wal directory)"
            ) from None
        self._lock_fd = fd

    # ------------------------------------------------------------------ internals
    def _start_segment(self) -> None:
        self._close_fd()
        path = self.directory / f"{self._next_lsn:020d}{_SUFFIX}"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.fsync:
            _fsync_dir(self.directory)
        self._segments.append(_Segment(path, self._next_lsn, self._next_lsn - 1, 0))

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _delete_committed(self) -> None:
        keep = []
        for index, segment in enumerate(self._segments):
            is_open = index == len(self._segments) - 1 and self._fd is not None
            if segment.last_lsn <= self._committed_lsn:
                if is_open:
                    self._close_fd()  # the next append starts a fresh segment
                try:
                    segment.path.unlink()
                except FileNotFoundError:
                    pass
            else:
                keep.append(segment)
        self._segments = keep


def _scan_bytes(data: bytes) -> tuple[list[tuple[int, int, int, int]], int, bool]:
    """Index records: [(lsn, signal, payload offset, length)], good bytes, clean end."""
    entries = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, crc, lsn, signal = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        end = start + length
        if end > len(data) or _crc(lsn, signal, data[start:end]) != crc:
            return entries, offset, False
        entries.append((lsn, signal, start, length))
        offset = end
    return entries, offset, offset == len(data)


def _write_all(fd: int, header: bytes, payload: bytes) -> None:
    written = os.writev(fd, [header, payload])
    total = len(header) + len(payload)
    if written < total:  # rare for regular files; finish the record byte-exactly
        rest = memoryview(header + payload)[written:]
        while rest:
            rest = rest[os.write(fd, rest) :]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
