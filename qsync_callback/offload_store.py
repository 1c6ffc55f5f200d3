"""Where offloaded activations wait for their backward: the next memory tier, behind one interface.

An `OffloadStore` takes a tensor that autograd saved for backward (`put`), moves its bytes to the
tier without making the caller wait for the copy, starts bringing them back ahead of need
(`prefetch`), and hands the tensor back (`get`) with the dtype, shape, strides and values it had.
What moves is the tensor's whole storage, as raw bytes whatever the dtype (bf16 and fp16 too;
never pickled); each key keeps its view (dtype, size, stride, offset) beside it. So the same
storage saved twice, or two views of it, is moved once: a storage is found again by a weak
reference to it and its version counter (the same bytes), and it is freed from the tier with the
release of its last key (`release`).

The tiers (`store_for`):

- **CPU: files on local disk** (`DiskStore`): one file of raw bytes per storage, in a private
  directory made for the store (``tempfile.mkdtemp``: mode 0700, under ``directory`` or the
  system's temporary directory; put it on a real disk: a tmpfs keeps the bytes in memory). One
  background thread writes and reads, in the order asked. `put` queues the write and returns; the
  tensor stays referenced until its bytes are written, then the store lets go of it, so the memory
  goes when the write is done. Forward never waits on the disk unless more than
  ``max_pending_bytes`` are waiting to be written (then `put` waits for the backlog to shrink:
  what bounds the memory a slow disk would keep; 0 makes every write synchronous). `prefetch`
  queues reads; `get` waits only for a read that has not finished, and reads one that was never
  asked for itself, in the calling thread.
  ``synchronous=True`` does without the thread: `put` writes and `get` reads in the calling thread,
  `prefetch` does nothing. That is the store the activation applier uses in training: the step's
  ops keep the cores busy (every core in one process by default, one per process under DDP), so a
  background copy only competes with them, and costs more than it hides. Measured on a 2-core VM (ResNet
  block of 16 MiB offloaded, 4 files of 4 MiB): reads prefetched beside backward ran at 1.9 GB/s by
  the store's clock against 5.6 GB/s alone, and the step paid 14.6 ms for the offload with the
  thread against 10.5 ms without it.
- **CUDA: pinned host memory** (`PinnedStore`): both copies run on one side stream. The copy out
  waits for the compute stream (where the saved tensor was made), and the tensor's memory is
  marked in use by the side stream (``record_stream``) so the caching allocator does not hand it
  out before the copy is done; the store then lets go of it at once. The copy back is allocated and
  run on the side stream; `get` makes the stream that asks wait for it (``wait_event``) and marks
  the memory in use there. On CUDA the GPU waits for a late copy, not the host.

Faults never break the step: a write that fails (a full disk, a file size limit: any OSError;
pinned memory that cannot be allocated) leaves the tensor where it was, in memory, and `get`
returns it. The store keeps the first failure as one line (what failed, where, how many bytes) in
`failure()`, moves nothing more, and the caller is expected to undo its plan. A read back that
fails cannot be made good (the bytes are only in the file): `get` raises.

The files go with their last key, at `close()`, and, if neither ran, when the store is garbage
collected or the process exits (``weakref.finalize``); a process killed by SIGKILL leaves its
``qsync-offload-*`` directory behind.

`step_stats()` says what moved since its last call: bytes, copies and seconds each way (the disk
thread's own clock around each file's write or read; CUDA events around each copy on CUDA), the
bandwidth they give, the seconds the training thread waited on the store, the gets that found
their bytes not back yet (late), and the bytes kept in memory by a failed write.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from qsync_callback.units import format_bytes

DEFAULT_MAX_PENDING_BYTES = 256 * 2**20
"""The disk store's default backlog: bytes waiting to be written before `put` waits."""

DIRECTORY_PREFIX = "qsync-offload-"


@dataclass(eq=False)
class _Copy:
    """One storage in the store: its bytes are in the tier, or still in memory (``source``)."""

    number: int
    ref: StorageWeakRef  # keeps the storage's identity unique while the copy lives
    version: int
    nbytes: int
    source: torch.Tensor | None  # its bytes, as uint8, until they are in the tier (or after a failure)
    keys: set[int] = field(default_factory=set)  # the live keys (views) of this storage
    ungot: set[int] = field(default_factory=set)  # keys not yet handed back since the bytes came back
    fetched: Any = None  # the tier's token of bytes coming back (or back), until every key got them
    in_tier: bool = False
    dropped: bool = False
    tier_state: Any = None  # the tier's own: the pinned buffer and its copy's event on CUDA


@dataclass(frozen=True, eq=False)
class _View:
    copy: _Copy
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Moves:
    bytes: int = 0
    copies: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.copies += 1
        self.seconds += seconds

    def figures(self) -> dict[str, Any]:
        bandwidth = self.bytes / self.seconds if self.seconds > 0 else None
        return {"bytes": self.bytes, "copies": self.copies, "seconds": self.seconds, "bytes_per_s": bandwidth}


@dataclass
class _Stats:
    to_store: _Moves = field(default_factory=_Moves)
    from_store: _Moves = field(default_factory=_Moves)
    waited_s: float = 0.0
    late: int = 0
    kept_in_memory_bytes: int = 0


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``tensor`` as a 1-D uint8 tensor (no copy)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _rebuild(data: torch.Tensor, view: _View) -> torch.Tensor:
    """``view`` of the storage under ``data`` (uint8 bytes)."""
    out = torch.empty(0, dtype=view.dtype, device=data.device)
    return out.set_(data.untyped_storage(), view.offset, view.size, view.stride)


class OffloadStore(ABC):
    """Saved tensors moved to the next memory tier of ``device`` and back (see the module docstring).

    Thread-safe: forward puts from the training thread, backward gets (on CUDA, from autograd's
    device thread), the graph releases wherever it is freed."""

    tier = ""
    prefetches = True  # whether `prefetch` starts reads (else `get` reads, and is never late)

    def __init__(self, device: torch.device):
        self.device = device
        self._lock = threading.Condition()
        self._numbers = itertools.count()
        self._views: dict[int, _View] = {}
        self._copies: dict[tuple[int, int], _Copy] = {}
        self._failure: str | None = None
        self._closed = False
        self._stats = _Stats()

    # --- the interface -----------------------------------------------------------------------

    def put(self, tensor: torch.Tensor) -> int:
        """Start moving ``tensor``'s storage to the tier (once per storage); its key for `get`."""
        if tensor.device != self.device:
            raise ValueError(
                f"the {self.tier} store of {self.device} cannot take a tensor on {tensor.device}"
            )
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        version = tensor._version
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.tier} offload store is closed")
            copy = self._copies.get((ref.cdata, version))
            new = copy is None
            if copy is None:
                copy = _Copy(next(self._numbers), ref, version, storage.nbytes(), _as_bytes(tensor))
                self._copies[(ref.cdata, version)] = copy
            key = next(self._numbers)
            copy.keys.add(key)
            self._views[key] = _View(
                copy, tensor.dtype, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset()
            )
            move = new and self._failure is None
            if new and not move:
                self._stats.kept_in_memory_bytes += copy.nbytes
        if move:
            self._move_out(copy)
        return key

    def prefetch(self, keys: Iterable[int]) -> None:
        """Start bringing back the bytes of ``keys`` (those in the tier and not already coming)."""
        if not self.prefetches:
            return
        with self._lock:
            for key in keys:
                view = self._views.get(key)
                if view is not None and view.copy.in_tier and view.copy.fetched is None and not self._closed:
                    view.copy.fetched = self._start_fetch(view.copy, urgent=False)
                    view.copy.ungot = set(view.copy.keys)

    def get(self, key: int) -> torch.Tensor:
        """The tensor put under ``key``, as it was; waits for its bytes only if they are not back."""
        with self._lock:
            view = self._views.get(key)
            if view is None:
                raise KeyError(f"no tensor under key {key} in the {self.tier} offload store (released)")
            copy = view.copy
            data, token = copy.source, copy.fetched
            if data is None and self._closed:
                raise RuntimeError(
                    f"the {self.tier} offload store was closed while a tensor in it was still needed "
                    "(undo a plan only between steps, after backward)"
                )
            if data is None and token is None:  # never prefetched: bring it now
                self._stats.late += self.prefetches
                token = copy.fetched = self._start_fetch(copy, urgent=True)
                copy.ungot = set(copy.keys)
        if data is None:
            data = self._finish_fetch(copy, token)
            with self._lock:
                copy.ungot.discard(key)
                if not copy.ungot and copy.fetched is token:
                    copy.fetched = None  # the tensors handed out keep the bytes as long as they need them
        return _rebuild(data, view)

    def release(self, key: int) -> None:
        """Forget ``key``; the storage leaves the tier with its last key."""
        with self._lock:
            view = self._views.pop(key, None)
            if view is None:
                return
            copy = view.copy
            copy.keys.discard(key)
            copy.ungot.discard(key)
            if copy.keys:
                return
            del self._copies[(copy.ref.cdata, copy.version)]
            copy.source = copy.fetched = None
            copy.dropped = True
            in_tier = copy.in_tier
        if in_tier:
            self._discard(copy)

    def failure(self) -> str | None:
        """The first fault (one line: what failed, where, how many bytes), or None."""
        with self._lock:
            return self._failure

    def step_stats(self) -> dict[str, Any]:
        """What moved since the last call (see the module docstring); the counts start again."""
        with self._lock:
            stats, self._stats = self._stats, _Stats()
        return {
            "tier": self.tier,
            "device": str(self.device),
            "to_store": stats.to_store.figures(),
            "from_store": stats.from_store.figures(),
            "waited_s": stats.waited_s,
            "late": stats.late,
            "kept_in_memory_bytes": stats.kept_in_memory_bytes,
        }

    def close(self) -> None:
        """Stop moving and free the tier (files removed); safe more than once. A tensor still only in
        memory (its write had not run, or failed) can still be got."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._shutdown()

    @property
    def closed(self) -> bool:
        return self._closed

    @abstractmethod
    def flush(self) -> None:
        """Wait until every copy to the tier asked for so far is done."""

    # --- what a tier does --------------------------------------------------------------------

    @abstractmethod
    def _move_out(self, copy: _Copy) -> None:
        """Start copying ``copy.source`` to the tier; on success set ``in_tier`` and drop ``source``."""

    @abstractmethod
    def _start_fetch(self, copy: _Copy, urgent: bool) -> Any:
        """Start bringing the bytes back (called under the lock); a token for `_finish_fetch`."""

    @abstractmethod
    def _finish_fetch(self, copy: _Copy, token: Any) -> torch.Tensor:
        """The bytes back (uint8, on the device), ready for the caller's use."""

    @abstractmethod
    def _discard(self, copy: _Copy) -> None:
        """Free the tier's copy of a storage whose last key was released."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Stop the tier's work and free everything it holds."""

    def _fail(self, what: str, copy: _Copy, error: BaseException | str) -> None:
        """Keep the first fault (called under the lock); the copy's bytes stay in memory."""
        self._stats.kept_in_memory_bytes += copy.nbytes
        if self._failure is None:
            cause = (error.strerror or str(error)) if isinstance(error, OSError) else str(error)
            self._failure = (
                f"{self.tier} offload store: {what} ({format_bytes(copy.nbytes)}) failed: {cause}; "
                "the tensor stayed in memory and the store moves nothing more"
            )


class DiskStore(OffloadStore):
    """The CPU tier: files on local disk, written and read by one background thread."""

    tier = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        synchronous: bool = False,
    ):
        super().__init__(torch.device("cpu"))
        if max_pending_bytes < 0:
            raise ValueError(f"max_pending_bytes must be at least 0, not {max_pending_bytes}")
        self.max_pending_bytes = 0 if synchronous else max_pending_bytes
        self.synchronous = synchronous
        self.prefetches = not synchronous
        self.directory = tempfile.mkdtemp(prefix=DIRECTORY_PREFIX, dir=directory)
        self._remove_directory = weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qsync-offload")
        self._pending_bytes = 0

    def flush(self) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._pending_bytes == 0 or self._closed)

    def _path(self, copy: _Copy) -> str:
        return os.path.join(self.directory, f"{copy.number}.bin")

    def _move_out(self, copy: _Copy) -> None:
        with self._lock:
            self._pending_bytes += copy.nbytes
            if not self.synchronous:
                self._worker.submit(self._write, copy)
                if self._pending_bytes > self.max_pending_bytes:
                    start = time.perf_counter()
                    self._lock.wait_for(lambda: self._pending_bytes <= self.max_pending_bytes or self._closed)
                    self._stats.waited_s += time.perf_counter() - start
                return
        start = time.perf_counter()
        self._write(copy)  # in the calling thread, which waits for it
        with self._lock:
            self._stats.waited_s += time.perf_counter() - start

    def _write(self, copy: _Copy) -> None:
        """The background thread's write of one storage (see `_move_out`)."""
        with self._lock:
            source = None if copy.dropped or self._failure is not None else copy.source
            if source is None:
                self._pending_bytes -= copy.nbytes
                self._lock.notify_all()
                if not copy.dropped:  # a failure came first: this one stays in memory too
                    self._stats.kept_in_memory_bytes += copy.nbytes
                return
        path = self._path(copy)
        start = time.perf_counter()
        try:
            _write_file(path, source)
        except OSError as error:
            _unlink(path)
            with self._lock:
                self._fail(f"writing {path}", copy, error)
                self._pending_bytes -= copy.nbytes
                self._lock.notify_all()
            return
        seconds = time.perf_counter() - start
        del source  # the store's copy.source is then the last reference this thread leaves
        with self._lock:
            self._stats.to_store.add(copy.nbytes, seconds)
            self._pending_bytes -= copy.nbytes
            self._lock.notify_all()
            remove = copy.dropped
            if not remove:
                copy.in_tier = True
                copy.source = None
        if remove:  # released while it was being written
            _unlink(path)

    def _read(self, copy: _Copy) -> torch.Tensor:
        path = self._path(copy)
        start = time.perf_counter()
        data = _read_file(path, copy.nbytes)
        seconds = time.perf_counter() - start
        with self._lock:
            self._stats.from_store.add(copy.nbytes, seconds)
        return data

    def _start_fetch(self, copy: _Copy, urgent: bool) -> Future:
        if not urgent:
            return self._worker.submit(self._read, copy)
        future: Future = Future()  # read in the calling thread: the queue may hold other reads
        start = time.perf_counter()
        try:
            future.set_result(self._read(copy))
        except OSError as error:
            future.set_exception(error)
        self._stats.waited_s += time.perf_counter() - start  # under the lock (`get`)
        return future

    def _finish_fetch(self, copy: _Copy, token: Future) -> torch.Tensor:
        late = not token.done()
        start = time.perf_counter()
        try:
            data = token.result()
        except OSError as error:
            raise RuntimeError(
                f"disk offload store: reading {format_bytes(copy.nbytes)} back from {self._path(copy)} "
                f"failed: {error.strerror or error}"
            ) from error
        except CancelledError:
            raise RuntimeError(
                "the disk offload store was closed before a tensor in it was read back"
            ) from None
        with self._lock:
            self._stats.waited_s += time.perf_counter() - start
            self._stats.late += late
        return data

    def _discard(self, copy: _Copy) -> None:
        _unlink(self._path(copy))

    def _shutdown(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._remove_directory()


def _write_file(path: str, data: torch.Tensor) -> None:
    """Write the bytes of ``data`` (1-D uint8 on the CPU) to a new file at ``path``."""
    view = memoryview(data.numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
    finally:
        os.close(fd)


def _read_file(path: str, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` bytes of the file at ``path``, as a uint8 CPU tensor."""
    data = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(data.numpy())
    with open(path, "rb", buffering=0) as file:
        done = 0
        while done < nbytes:
            got = file.readinto(view[done:])
            if not got:
                raise OSError(f"{path} ends after {done} of {nbytes} bytes")
            done += got
    return data


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_PENDING_TIMINGS = 256  # copies whose CUDA events the pinned store keeps before folding them in


class PinnedStore(OffloadStore):
    """The CUDA tier: pinned host memory, both copies on one side stream."""

    tier = "pinned"

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._stream = torch.cuda.Stream(device)
        self._timings: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []

    def _timed_copy(
        self, direction: str, nbytes: int, out: torch.Tensor, source: torch.Tensor
    ) -> torch.cuda.Event:
        """``out.copy_(source)`` on the side stream, between two timing events (the later returned)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record(self._stream)
            out.copy_(source, non_blocking=True)
            end.record(self._stream)
        self._timings.append((direction, nbytes, start, end))
        if len(self._timings) > _PENDING_TIMINGS:  # nobody asked for the stats lately: fold them in
            self._settle(wait=False)
        return end

    def _move_out(self, copy: _Copy) -> None:
        with self._lock:
            source = copy.source
            try:
                host = torch.empty(copy.nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as error:  # pinned memory exhausted: the tensor stays on the device
                self._fail("allocating pinned host memory", copy, error)
                return
            # the saved tensor was made on the stream that saves it: copy it only once it is written
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            written = self._timed_copy("to", copy.nbytes, host, source)
            source.record_stream(self._stream)  # its memory is not handed out again before the copy ran
            copy.tier_state = (host, written)
            copy.in_tier = True
            copy.source = None

    def _start_fetch(self, copy: _Copy, urgent: bool) -> tuple[torch.Tensor, torch.cuda.Event]:
        host, _ = copy.tier_state  # copied out earlier on the same stream: the copy back comes after it
        with torch.cuda.stream(self._stream):
            data = torch.empty(copy.nbytes, dtype=torch.uint8, device=self.device)
        return data, self._timed_copy("from", copy.nbytes, data, host)

    def _finish_fetch(self, copy: _Copy, token: tuple[torch.Tensor, torch.cuda.Event]) -> torch.Tensor:
        data, done = token
        user = torch.cuda.current_stream(self.device)
        user.wait_event(done)
        data.record_stream(user)  # made on the side stream, used (and freed) on the user's
        return data

    def _discard(self, copy: _Copy) -> None:
        # the pinned block returns to torch's host cache, which waits for the copies recorded on it
        copy.tier_state = None

    def flush(self) -> None:
        self._stream.synchronize()

    def step_stats(self) -> dict[str, Any]:
        self._settle(wait=True)
        return super().step_stats()

    def _settle(self, wait: bool) -> None:
        """Bring the times of the copies done (all of them, waited for, with ``wait``) into the
        stats, and let go of their events."""
        with self._lock:
            timings, self._timings = self._timings, []
        if wait:
            for _, _, _, end in timings:
                end.synchronize()
        finished = [timing[3].query() for timing in timings]
        with self._lock:
            for (direction, nbytes, start, end), done in zip(timings, finished, strict=True):
                if done:
                    moves = self._stats.to_store if direction == "to" else self._stats.from_store
                    moves.add(nbytes, start.elapsed_time(end) / 1e3)
            self._timings[:0] = [timing for timing, done in zip(timings, finished, strict=True) if not done]

    def _shutdown(self) -> None:
        self._stream.synchronize()
        with self._lock:
            for copy in list(self._copies.values()):
                copy.tier_state = copy.fetched = None


def store_for(
    device: torch.device | str,
    directory: str | os.PathLike[str] | None = None,
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    synchronous: bool = False,
) -> OffloadStore:
    """The offload store of ``device``'s next memory tier: a `DiskStore` for the CPU (in a private
    directory under ``directory``, with ``max_pending_bytes`` of write backlog, or ``synchronous``),
    a `PinnedStore` for a CUDA device. ValueError for any other device."""
    device = torch.device(device)
    if device.type == "cpu":
        return DiskStore(directory, max_pending_bytes, synchronous)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return PinnedStore(torch.device("cuda", index))
    raise ValueError(f"no offload tier for a {device.type} device (there is one for cpu and cuda)")
