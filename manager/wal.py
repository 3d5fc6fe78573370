"""The state directory: a write-ahead log of applied changes and periodic snapshots (docs/durability.md).

Files in the directory (``--state-dir``), all written only by the manager that holds ``LOCK``:

- ``LOCK``: ``flock``-ed while a manager uses the directory (a second one refuses to start).
- ``snapshot``: the whole manager state at some point: ``MAGIC``, a version, then a pickle of
  plain data (lists, dicts, ints, bytes, the manager's operation records and answers). It names
  the log segment that follows it (``log_seq``). Written atomically: ``snapshot.tmp``, fsync,
  rename, fsync of the directory.
- ``wal.NNNNNNNN``: log segments. Each record is ``length (u32 LE) | crc32 (u32 LE) | payload``,
  the CRC (``zlib.crc32``) over the length bytes and the payload; the payload is a pickle.
  Only the segments numbered ``>= log_seq`` of the snapshot are live; older ones are deleted.

Reading a segment: a last record that is torn (cut short, or zeros to the end of the file, or a
bad CRC on the very last record) is dropped and the file truncated to the last good record: it
was never acknowledged (the answer leaves only after the write). A bad record followed by more
data is corruption: ``CorruptState``, and the manager refuses to start.

pickle runs code when loading: the state directory is the operator's local, trusted state, as
trusted as the manager's own code; never point --state-dir at a directory others can write.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import struct
import threading
import time
import zlib
from typing import Any, Callable, Optional

MAGIC = b"KVPAGER-STATE\n"
VERSION = 1
_HEADER = struct.Struct("<II")
SNAPSHOT = "snapshot"
FSYNC_MODES = ("always", "batch", "never")
BATCH_INTERVAL = 0.01  # seconds between fsyncs in --fsync batch
MAX_RECORD = 1 << 30
EXIT_LOG_FAILED = 75  # the process exits with this when the log cannot be written (nothing unlogged is answered)
log = logging.getLogger("kvpager.manager")


class CorruptState(Exception):
    """The state directory cannot be recovered without losing acknowledged changes."""


def _segment_name(seq: int) -> str:
    return f"wal.{seq:08d}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def frame(payload: bytes) -> bytes:
    length = struct.pack("<I", len(payload))
    return length + struct.pack("<I", zlib.crc32(payload, zlib.crc32(length))) + payload


def read_records(path: str, last: bool) -> tuple[list[Any], int, Optional[str]]:
    """The records of one segment, the offset after the last good one, and why the rest was
    dropped (None: nothing dropped). ``last``: this is the newest segment, the only one whose
    tail may be torn; elsewhere any damage is corruption."""
    with open(path, "rb") as f:
        data = f.read()
    records: list[Any] = []
    pos, n = 0, len(data)
    while pos < n:
        problem = None
        if n - pos < _HEADER.size:
            problem = "a record header cut short"
        else:
            length, crc = _HEADER.unpack_from(data, pos)
            end = pos + _HEADER.size + length
            if length > MAX_RECORD or end > n:
                problem = f"a record of {length} bytes cut short at {n - pos - _HEADER.size}"
                later = _next_good_record(data, pos + 1)
                if later is not None:  # a damaged length, not a torn tail: good records follow
                    raise CorruptState(
                        f"{path}: {problem} at offset {pos}, yet a good record starts at offset {later}: the "
                        "record's length is damaged and the log is corrupt before its last record; refusing to "
                        "start (acknowledged changes would be lost). Restore the state directory from a backup, "
                        "or move it away to start empty")
            elif zlib.crc32(data[pos + _HEADER.size:end], zlib.crc32(data[pos:pos + 4])) != crc:
                problem = "a record whose CRC does not match"
                if end < n and any(data[end:]):  # good data follows: the damage is not a torn tail
                    raise CorruptState(
                        f"{path}: {problem} at offset {pos}, followed by {n - end} more bytes: the log is corrupt "
                        "before its last record; refusing to start (acknowledged changes would be lost). Restore "
                        "the state directory from a backup, or move it away to start empty")
        if problem is not None:
            if not last and not _torn_zeros(data, pos):
                raise CorruptState(f"{path}: {problem} at offset {pos}, in a log segment that is not the newest; "
                                   "refusing to start. Restore the state directory from a backup, or move it away "
                                   "to start empty")
            return records, pos, f"{problem} at offset {pos} ({n - pos} bytes dropped)"
        try:
            records.append(pickle.loads(data[pos + _HEADER.size:end]))
        except Exception as exc:
            raise CorruptState(f"{path}: the record at offset {pos} has a good CRC but cannot be read ({exc!r}); "
                               "refusing to start") from exc
        pos = end
    return records, pos, None


def _torn_zeros(data: bytes, pos: int) -> bool:
    return not any(data[pos:])


def _next_good_record(data: bytes, start: int) -> Optional[int]:
    """The first offset at or after ``start`` where a whole record with a matching CRC lies, if
    any. A torn last record is the log's last bytes, so none follows it; a record whose length
    field was damaged has its successors after it. Only read after a record found cut short, at
    recovery; a candidate is checked in O(1) unless its length fits what is left."""
    n = len(data)
    for q in range(start, n - _HEADER.size + 1):
        length, crc = _HEADER.unpack_from(data, q)
        end = q + _HEADER.size + length
        if end <= n and zlib.crc32(data[q + _HEADER.size:end], zlib.crc32(data[q:q + 4])) == crc:
            if length or any(data[q:q + _HEADER.size]):   # a record of zeros is a zero-filled tail
                return q
    return None


class StateDir:
    """The log and snapshots of one state directory. Not thread-safe: the service calls it
    under its state lock (the batch-mode flusher takes ``_io_lock``)."""

    def __init__(self, path: str, fsync: str = "always", snapshot_records: int = 10_000,
                 snapshot_bytes: int = 64 << 20) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_MODES)}, got {fsync!r}")
        self.path = path
        self.fsync = fsync
        self.snapshot_records = snapshot_records
        self.snapshot_bytes = snapshot_bytes
        if os.path.exists(path) and not os.path.isdir(path):
            raise CorruptState(f"{path} is not a directory (--state-dir names the folder of the log and snapshots)")
        created = not os.path.isdir(path)
        os.makedirs(path, mode=0o700, exist_ok=True)
        if created:   # its entry in the parent durable too, before anything in it is acknowledged
            _fsync_dir(os.path.dirname(os.path.abspath(path)))
        self._lock_fd = os.open(os.path.join(path, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(self._lock_fd)
            raise CorruptState(f"state directory {path} is in use by another manager (LOCK is held)") from err
        self._fd: Optional[int] = None
        self.seq = 0                 # number of the segment being appended to
        self.records = 0             # records in it
        self.bytes = 0               # its size
        self.records_total = 0       # records appended since start (for stats/tests)
        self.snapshots = 0
        self._snapshot_after = 0     # records_total before which no snapshot is due (defer_snapshot)
        self._io_lock = threading.Lock()
        self._dirty = False
        self._stop = threading.Event()
        self._flusher: Optional[threading.Thread] = None
        self.dropped: Optional[str] = None  # why a torn tail was dropped at recovery
        # Metrics hooks (manager/metrics.py): an appended record's (bytes, seconds of write and
        # fsync), a snapshot's (bytes, seconds).
        self.on_append: Optional[Callable[[int, float], None]] = None
        self.on_snapshot: Optional[Callable[[int, float], None]] = None

    # ---- recovery ------------------------------------------------------------------------------
    def load(self) -> tuple[Optional[dict[str, Any]], list[Any]]:
        """The snapshot (None: none yet) and the log records after it, in order. Truncates a torn
        tail, deletes segments the snapshot made obsolete, and opens the log for appending."""
        snap = None
        snap_path = os.path.join(self.path, SNAPSHOT)
        if os.path.exists(snap_path):
            with open(snap_path, "rb") as f:
                head = f.read(len(MAGIC) + 4)
                if head[:len(MAGIC)] != MAGIC or len(head) < len(MAGIC) + 4:
                    raise CorruptState(f"{snap_path} is not a kvpager snapshot (bad magic, or cut short); refusing to start")
                (version,) = struct.unpack("<I", head[len(MAGIC):])
                if version != VERSION:
                    raise CorruptState(f"{snap_path} has version {version}; this manager reads version {VERSION}")
                body = f.read()
            if len(body) < 4 or zlib.crc32(body[4:]) != struct.unpack("<I", body[:4])[0]:
                raise CorruptState(f"{snap_path}: CRC mismatch; refusing to start")
            snap = pickle.loads(body[4:])
        first = snap["log_seq"] if snap is not None else 0
        segments = sorted(int(name[4:]) for name in os.listdir(self.path)
                          if name.startswith("wal.") and name[4:].isdigit())
        for s in segments:
            if s < first:
                os.unlink(os.path.join(self.path, _segment_name(s)))
        live = [s for s in segments if s >= first]
        if live and live[0] != first and snap is not None:
            raise CorruptState(f"{self.path}: the snapshot is followed by segment {first}, but the first one found is "
                               f"{live[0]}; refusing to start")
        records: list[Any] = []
        for i, s in enumerate(live):
            if i and s != live[i - 1] + 1:
                raise CorruptState(f"{self.path}: log segment {live[i - 1] + 1} is missing; refusing to start")
            path = os.path.join(self.path, _segment_name(s))
            got, good, dropped = read_records(path, last=i == len(live) - 1)
            if dropped is not None:
                self.dropped = f"{path}: {dropped}"
                with open(path, "r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
            records.extend(got)
            self.records = len(got)
        self.seq = live[-1] if live else first
        self._open_segment(self.seq)
        return snap, records

    # ---- writing -------------------------------------------------------------------------------
    def _open_segment(self, seq: int) -> None:
        path = os.path.join(self.path, _segment_name(seq))
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.bytes = os.fstat(self._fd).st_size
        _fsync_dir(self.path)
        if self.fsync == "batch" and self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="kvpager-wal-flush", daemon=True)
            self._flusher.start()

    def append(self, record: Any) -> None:
        """Append one record (one write; fsync as --fsync says). Raises OSError when the write fails."""
        data = frame(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
        if len(data) - _HEADER.size > MAX_RECORD:   # recovery would read it as torn, and drop what follows
            raise OSError(f"a log record of {len(data) - _HEADER.size} bytes is above the {MAX_RECORD}-byte limit")
        started = time.perf_counter()
        with self._io_lock:
            fd = self._open_fd()
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(f"short write to the log: {written} of {len(data)} bytes")
            if self.fsync == "always":
                os.fdatasync(fd)
            else:
                self._dirty = True
        self.records += 1
        self.records_total += 1
        self.bytes += len(data)
        if self.on_append is not None:
            self.on_append(len(data), time.perf_counter() - started)

    def due(self) -> bool:
        """Time for a snapshot (every ``snapshot_records`` records or ``snapshot_bytes`` of log;
        after a failed one, not before ``snapshot_records`` more records)."""
        return ((self.records >= self.snapshot_records or self.bytes >= self.snapshot_bytes)
                and self.records_total >= self._snapshot_after)

    def defer_snapshot(self) -> None:
        """A snapshot failed (the log is left as it was): try again ``snapshot_records`` records on."""
        self._snapshot_after = self.records_total + self.snapshot_records

    def snapshot(self, state: dict[str, Any]) -> None:
        """Write ``state`` as the snapshot, then start a new segment and delete the old one."""
        started = time.perf_counter()
        state = dict(state, log_seq=self.seq + 1, written_at=time.time())
        body = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        tmp = os.path.join(self.path, SNAPSHOT + ".tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(MAGIC + struct.pack("<I", VERSION) + struct.pack("<I", zlib.crc32(body)) + body)
            f.flush()
            os.fsync(f.fileno())
        with self._io_lock:
            old_fd = self._open_fd()
            if self._dirty:
                os.fdatasync(old_fd)
                self._dirty = False
            # The segment the snapshot names exists before the snapshot does: a failure up to the
            # rename leaves the old snapshot and segment in use (an empty next segment is harmless).
            old = self.seq
            new_fd = os.open(os.path.join(self.path, _segment_name(old + 1)),
                             os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                _fsync_dir(self.path)
                os.replace(tmp, os.path.join(self.path, SNAPSHOT))
            except BaseException:
                os.close(new_fd)
                raise
            # From here the snapshot names the new segment: later records go there whatever follows.
            self._fd, self.seq, self.records, self.bytes = new_fd, old + 1, 0, 0
            os.close(old_fd)
            _fsync_dir(self.path)   # the rename durable before the old segment goes
            os.unlink(os.path.join(self.path, _segment_name(old)))
        self.snapshots += 1
        if self.on_snapshot is not None:
            self.on_snapshot(len(body), time.perf_counter() - started)

    def _open_fd(self) -> int:
        """The open segment's file descriptor; OSError when none is open (before ``load``, after ``close``)."""
        if self._fd is None:
            raise OSError(f"the state log in {self.path} is not open")
        return self._fd

    def _flush_loop(self) -> None:
        while not self._stop.wait(BATCH_INTERVAL):
            with self._io_lock:
                if self._dirty and self._fd is not None:
                    try:
                        os.fdatasync(self._fd)
                    except OSError:
                        # What was answered since the last fsync may not be durable: stop, as a
                        # failed write does (recovery.py commit); a restart recovers what is.
                        log.critical("cannot fsync the state log in %s; stopping", self.path, exc_info=True)
                        os._exit(EXIT_LOG_FAILED)
                    self._dirty = False

    def close(self) -> None:
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=5)
        with self._io_lock:
            if self._fd is not None:
                if self._dirty:
                    os.fdatasync(self._fd)
                os.close(self._fd)
                self._fd = None
        os.close(self._lock_fd)
