"""The shared-memory segment N router processes share: fixed layout, no pickling, no locks on reads.

    header  | magic nprocs restarts next_slot log_head log_cap log_tail -   (8 x u64)
    procs   | per process: pid admission_inflight admission_waiting served  (nprocs x 8 x u64)
    keys    | per worker slot: blake2b(worker id), 0 = free                  (MAX_WORKERS x u64)
    cells   | per slot, per process: inflight backlog_s floor_s stamp        (MAX_WORKERS x nprocs x 4 x f64)
    blobs   | per process, then one for admin state: seq len payload (a seqlock: odd seq = being written)
    log     | a ring of records [len u32][kind u8][writer u8][pad u16][payload]; log_head counts bytes ever written

Each process writes only its own proc row, its own cells and its own blob (8-byte aligned stores, so a
reader sees old or new, never torn values); claiming a slot and appending to the log take the lock.
A reader lapped by the log (more than `log_cap` bytes behind) skips to the head and counts the loss.
"""
from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
from typing import Any

MAGIC = 0x6B696D6970647031          # "kimipdp1"
MAX_WORKERS = 1024
CELL = 4                            # inflight, backlog_s, floor_s, stamp
BLOB_CAP = 256 << 10
LOG_CAP = 8 << 20
_HEADER, _PROC = 8, 8               # u64 fields
_REC = struct.Struct("<IBBH")


def worker_key(worker_id: str) -> int:
    """A nonzero 64-bit key for a worker id (0 marks a free slot)."""
    return int.from_bytes(hashlib.blake2b(worker_id.encode(), digest_size=8).digest(), "little") or 1


class SharedTable:
    """One segment, a file mapped by every process (/dev/shm when there is one): `create` in the parent,
    `attach` in each child by path, with the parent's lock. A file rather than `multiprocessing.shared_memory`,
    whose resource tracker unlinks a segment when any attached process exits (Python < 3.13)."""

    def __init__(self, path: str, mm: mmap.mmap, lock: Any, owner: bool) -> None:
        self.path, self.mm, self.lock, self.owner = path, mm, lock, owner
        buf = memoryview(mm)
        self.u64 = buf.cast("Q")
        self.nprocs = self.u64[1]
        n = self.nprocs
        self._procs = _HEADER
        self._keys = self._procs + n * _PROC
        self._cells = (self._keys + MAX_WORKERS) * 8          # byte offsets from here on
        self._blobs = self._cells + MAX_WORKERS * n * CELL * 8
        self._log = self._blobs + (n + 1) * (16 + BLOB_CAP)
        self.f64 = buf[self._cells:self._blobs].cast("d")
        self.buf = buf

    @staticmethod
    def size(nprocs: int) -> int:
        return (_HEADER + nprocs * _PROC + MAX_WORKERS) * 8 + MAX_WORKERS * nprocs * CELL * 8 \
            + (nprocs + 1) * (16 + BLOB_CAP) + LOG_CAP

    @classmethod
    def create(cls, path: str, nprocs: int, lock: Any) -> SharedTable:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, cls.size(nprocs))
            mm = mmap.mmap(fd, cls.size(nprocs))
        finally:
            os.close(fd)
        struct.pack_into("<QQ", mm, 0, MAGIC, nprocs)
        struct.pack_into("<Q", mm, 40, LOG_CAP)
        return cls(path, mm, lock, owner=True)

    @classmethod
    def attach(cls, path: str, lock: Any) -> SharedTable:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if struct.unpack_from("<Q", mm, 0)[0] != MAGIC:
            raise RuntimeError(f"{path} is not a router table")
        return cls(path, mm, lock, owner=False)

    def close(self) -> None:
        for view in (self.f64, self.u64, self.buf):
            view.release()
        with contextlib.suppress(BufferError):             # a view still exported: the mapping goes at exit
            self.mm.close()
        if self.owner:
            os.unlink(self.path)

    # ---- header and process rows ----------------------------------------------------------------
    @property
    def restarts(self) -> int:
        return self.u64[2]

    def count_restart(self) -> None:
        self.u64[2] += 1                                   # the parent is the only writer

    def proc(self, index: int, field: int) -> int:
        return self.u64[self._procs + index * _PROC + field]

    def set_proc(self, index: int, field: int, value: int) -> None:
        self.u64[self._procs + index * _PROC + field] = max(0, value)

    def proc_sum(self, field: int, skip: int) -> int:
        return sum(self.proc(i, field) for i in range(self.nprocs) if i != skip)

    def clear_proc(self, index: int) -> None:
        """Forget a dead process's load: its legs ended with it (the parent calls this before a restart)."""
        for f in range(_PROC):
            self.set_proc(index, f, 0)
        for slot in range(self.u64[3]):
            base = (slot * self.nprocs + index) * CELL
            for k in range(CELL):
                self.f64[base + k] = 0.0

    # ---- worker slots ---------------------------------------------------------------------------
    def used_slots(self) -> int:
        return self.u64[3]

    def find_slot(self, worker_id: str) -> int | None:
        """The worker's slot, claimed if it has none; None when the table is full."""
        key = worker_key(worker_id)
        slot = self._scan(key)
        if slot is not None:
            return slot
        with self.lock:
            slot = self._scan(key)
            if slot is None and self.u64[3] < MAX_WORKERS:
                slot = self.u64[3]
                self.u64[self._keys + slot] = key
                self.u64[3] = slot + 1
        return slot

    def _scan(self, key: int) -> int | None:
        keys = self.u64[self._keys:self._keys + self.u64[3]]
        try:
            return keys.tolist().index(key)
        except ValueError:
            return None

    def write_cell(self, slot: int, index: int, values: tuple[float, float, float, float]) -> None:
        base = (slot * self.nprocs + index) * CELL
        self.f64[base + 3] = 0.0                           # a stamp of 0: being written, readers skip
        self.f64[base], self.f64[base + 1], self.f64[base + 2] = values[0], values[1], values[2]
        self.f64[base + 3] = values[3]

    def cells(self) -> list[Any]:
        """Every used slot's cells, one copy: slot s, process p at [(s * nprocs + p) * CELL]."""
        return self.f64[:self.u64[3] * self.nprocs * CELL].tolist()

    # ---- per-process blobs (seqlock) ------------------------------------------------------------
    def write_blob(self, index: int, payload: bytes) -> None:
        if len(payload) > BLOB_CAP:
            raise ValueError(f"blob of {len(payload)} bytes exceeds {BLOB_CAP}")
        off = self._blobs + index * (16 + BLOB_CAP)
        seq_at = off // 8
        self.u64[seq_at] += 1                              # odd: being written
        self.u64[seq_at + 1] = len(payload)
        self.buf[off + 16:off + 16 + len(payload)] = payload
        self.u64[seq_at] += 1

    def read_blob(self, index: int) -> bytes | None:
        off = self._blobs + index * (16 + BLOB_CAP)
        seq_at = off // 8
        for _ in range(100):
            seq = self.u64[seq_at]
            if seq % 2:
                continue
            data = bytes(self.buf[off + 16:off + 16 + self.u64[seq_at + 1]])
            if self.u64[seq_at] == seq:
                return data if seq else None
        return None

    # ---- the event log --------------------------------------------------------------------------
    @property
    def log_head(self) -> int:
        return self.u64[4]

    @property
    def log_tail(self) -> int:
        """Where the oldest record still whole in the ring starts (a new reader starts there)."""
        return self.u64[6]

    def append(self, kind: int, writer: int, payload: bytes) -> None:
        record = _REC.pack(_REC.size + len(payload), kind, writer, 0) + payload
        if len(record) > LOG_CAP // 4:
            raise ValueError(f"log record of {len(record)} bytes is too large")
        with self.lock:
            head, tail = self.u64[4], self.u64[6]
            while head + len(record) - tail > LOG_CAP:          # records about to be overwritten
                tail += _REC.unpack(self._ring_read(tail, _REC.size))[0]
            self.u64[6] = tail
            self._ring_write(head, record)
            self.u64[4] = head + len(record)

    def read_since(self, pos: int) -> tuple[int, list[tuple[int, int, bytes]], bool]:
        """Records from byte position `pos` to the head: (new position, [(kind, writer, payload)], lapped)."""
        head = self.u64[4]
        if pos < self.u64[6]:
            return head, [], True
        start, out = pos, []
        data, at = self._ring_read(pos, head - pos), 0          # one copy of the span, split here
        while at < len(data):
            length, kind, writer, _ = _REC.unpack_from(data, at)
            out.append((kind, writer, data[at + _REC.size:at + length]))
            at += length
        pos += at
        if self.u64[6] > start:
            return self.u64[4], [], True                   # overwritten while we read
        return pos, out, False

    def _ring_write(self, pos: int, data: bytes) -> None:
        at = pos % LOG_CAP
        first = min(len(data), LOG_CAP - at)
        self.buf[self._log + at:self._log + at + first] = data[:first]
        if first < len(data):
            self.buf[self._log:self._log + len(data) - first] = data[first:]

    def _ring_read(self, pos: int, n: int) -> bytes:
        at = pos % LOG_CAP
        first = min(n, LOG_CAP - at)
        data = bytes(self.buf[self._log + at:self._log + at + first])
        if first < n:
            data += bytes(self.buf[self._log:self._log + n - first])
        return data
