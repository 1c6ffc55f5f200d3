"""The offload stores on real tensors and real files: round trips, one copy per storage, prefetch,
the files' lifetime (release, close, process exit) and a real write fault (a file size limit)."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from qsync_callback import offload_store
from qsync_callback.lp.costs import cache_path
from qsync_callback.offload_store import DIRECTORY_PREFIX, DiskStore, PinnedStore, store_for
from qsync_callback.recorder.copy_costs import COPY_SIZES, copy_costs, fit_copy_costs


def _files(store):
    return sorted(os.listdir(store.directory))


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


def _run_python(code):
    """Run ``code`` in a fresh interpreter; its last stdout line, parsed as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_disk_round_trip_keeps_dtype_shape_strides_and_bytes(tmp_path, dtype):
    store = DiskStore(tmp_path, max_pending_bytes=0)
    base = (torch.randn(64, 48) * 100).to(dtype)
    tensors = [base, base[3:, ::2], base.t()]  # a view with an offset and strides, a transpose
    keys = [store.put(t) for t in tensors]
    assert len(_files(store)) == 1  # one storage, one file
    for key, tensor in zip(keys, tensors, strict=True):
        back = store.get(key)
        assert _same(back, tensor)
        assert back.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()  # read from the file
    stats = store.step_stats()
    assert (stats["to_store"]["bytes"], stats["to_store"]["copies"]) == (base.untyped_storage().nbytes(), 1)
    assert stats["from_store"]["copies"] == 1  # the three keys share the bytes read back once
    store.close()


def test_one_copy_per_storage_and_version_and_files_go_with_the_last_key(tmp_path):
    store = DiskStore(tmp_path, max_pending_bytes=0)
    x = torch.randn(1000)
    before = x.clone()
    first, again = store.put(x), store.put(x)
    assert len(_files(store)) == 1
    x.add_(1)  # the same storage with other bytes: a copy of its own
    changed = store.put(x)
    assert len(_files(store)) == 2
    assert torch.equal(store.get(first), before) and torch.equal(store.get(again), before)
    assert torch.equal(store.get(changed), x)
    assert store.step_stats()["to_store"]["bytes"] == 2 * x.untyped_storage().nbytes()
    store.release(first)
    assert len(_files(store)) == 2  # `again` still holds the first copy
    store.release(again)
    store.release(changed)
    assert _files(store) == []
    store.close()


def test_a_written_tensor_is_let_go_and_comes_back_prefetched_or_late(tmp_path):
    store = DiskStore(tmp_path, max_pending_bytes=0)
    x = torch.randn(4096)
    expected = x.clone()
    ref = StorageWeakRef(x.untyped_storage())
    key = store.put(x)
    del x
    assert ref.expired()  # written before put returned (no backlog allowed): the memory is gone
    assert os.path.getsize(os.path.join(store.directory, _files(store)[0])) == expected.numel() * 4
    late = store.get(key)  # never prefetched: read in the calling thread, counted late
    assert torch.equal(late, expected)
    store.prefetch([key])
    assert torch.equal(store.get(key), expected)
    stats = store.step_stats()
    assert stats["late"] >= 1 and stats["from_store"]["copies"] == 2
    assert stats["from_store"]["bytes_per_s"] > 0
    store.close()


def test_a_synchronous_store_copies_in_the_calling_thread_and_never_prefetches(tmp_path):
    store = DiskStore(tmp_path, max_pending_bytes=1 << 30, synchronous=True)
    assert store.max_pending_bytes == 0  # no backlog: its writes are the caller's
    x = torch.randn(4096)
    expected = x.clone()
    ref = StorageWeakRef(x.untyped_storage())
    key = store.put(x)
    del x
    assert ref.expired() and len(_files(store)) == 1  # written before put returned
    assert store.step_stats()["waited_s"] > 0  # the caller waited for the write
    store.prefetch([key])  # nothing starts: the read waits for get, in the caller's thread
    assert store._worker._threads == set()  # the store's thread was never started
    assert torch.equal(store.get(key), expected)
    stats = store.step_stats()
    assert stats["from_store"]["copies"] == 1 and stats["late"] == 0 and stats["waited_s"] > 0
    store.close()
    assert not os.path.exists(store.directory)


def test_backlog_lets_put_return_before_the_write(tmp_path):
    store = DiskStore(tmp_path)  # the default backlog: puts do not wait for the disk
    tensors = [torch.randn(2**16) for _ in range(8)]
    keys = [store.put(t) for t in tensors]
    store.flush()
    assert len(_files(store)) == 8
    assert all(torch.equal(store.get(k), t) for k, t in zip(keys, tensors, strict=True))
    store.close()


def test_close_removes_the_directory_and_refuses_what_needs_it(tmp_path):
    store = store_for("cpu", tmp_path, max_pending_bytes=0)
    assert isinstance(store, DiskStore) and os.path.dirname(store.directory) == str(tmp_path)
    assert os.path.basename(store.directory).startswith(DIRECTORY_PREFIX)
    key = store.put(torch.randn(1000))
    store.close()
    store.close()  # twice is fine
    assert not os.path.exists(store.directory)
    with pytest.raises(RuntimeError, match="closed"):
        store.get(key)
    with pytest.raises(RuntimeError, match="closed"):
        store.put(torch.randn(10))


def test_store_for_refuses_a_device_without_a_tier():
    with pytest.raises(ValueError, match="no offload tier for a meta device"):
        store_for("meta")


def test_the_directory_goes_at_exit_when_nobody_closed_the_store(tmp_path):
    out = _run_python(
        f"""
        import json, os, torch
        from qsync_callback.offload_store import store_for
        store = store_for("cpu", {str(tmp_path)!r}, max_pending_bytes=0)
        store.put(torch.randn(1000))
        print(json.dumps({{"directory": store.directory, "files": len(os.listdir(store.directory))}}))
        """
    )
    assert out["files"] == 1
    assert not os.path.exists(out["directory"])
    assert os.listdir(tmp_path) == []


def test_a_write_beyond_the_file_size_limit_keeps_the_tensor_in_memory(tmp_path):
    """A real fault: RLIMIT_FSIZE (SIGXFSZ ignored, so the write gets EFBIG) in a fresh process."""
    out = _run_python(
        f"""
        import json, resource, signal, torch
        from qsync_callback.offload_store import store_for
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
        store = store_for("cpu", {str(tmp_path)!r}, max_pending_bytes=0)
        small, big, after = torch.randn(1000), torch.randn(2**18), torch.randn(1000)
        keys = [store.put(t) for t in (small, big, after)]
        back = [store.get(k) for k in keys]
        stats = store.step_stats()
        print(json.dumps({{
            "failure": store.failure(),
            "equal": [torch.equal(a, b) for a, b in zip(back, (small, big, after))],
            "big_in_memory": back[1].untyped_storage().data_ptr() == big.untyped_storage().data_ptr(),
            "written": stats["to_store"]["copies"], "kept": stats["kept_in_memory_bytes"],
            "directory": store.directory,
        }}))
        store.close()
        """
    )
    assert out["equal"] == [True, True, True]
    assert out["big_in_memory"]
    assert out["written"] == 1  # the small one before the fault; nothing after it
    assert out["kept"] == 2**20 + 4000  # the big one (1 MiB) and the one after
    failure = out["failure"]
    assert "disk offload store: writing" in failure and out["directory"] in failure
    assert "(1.0 MiB)" in failure and "File too large" in failure and "stayed in memory" in failure
    assert not os.path.exists(out["directory"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-memory tier needs CUDA (none here)")
def test_pinned_round_trip_on_a_side_stream():
    device = torch.device("cuda")
    store = store_for(device)
    assert isinstance(store, PinnedStore)
    base = torch.randn(512, 256, device=device, dtype=torch.bfloat16)
    tensors = [base, base[7:, ::4], torch.randn(1000, device=device)]
    expected = [t.clone() for t in tensors]
    keys = [store.put(t) for t in tensors]
    del tensors, base
    store.prefetch(keys[:2])
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):  # a stream other than the one that saved them waits for its copies
        back = [store.get(k) for k in keys]
        equal = [_same(b, e) for b, e in zip(back, expected, strict=True)]
    assert all(equal)
    stats = store.step_stats()
    assert stats["to_store"]["copies"] == 2 and stats["from_store"]["copies"] == 2
    assert stats["late"] == 1 and stats["to_store"]["bytes_per_s"] > 0
    for key in keys:
        store.release(key)
    store.close()


# --- the copy costs --------------------------------------------------------------------------------


def test_copy_costs_are_fitted_with_the_disk_store_and_cached_per_device_and_directory(tmp_path):
    cache, offload = tmp_path / "cache", tmp_path / "offload"
    offload.mkdir()
    costs = copy_costs("cpu", offload, cache)
    assert costs["tier"] == "disk" and costs["source"] == "measured" and costs["sizes"] == list(COPY_SIZES)
    for direction in ("to_store", "from_store"):
        fit = costs[direction]
        assert fit["alpha_us"] >= 0 and fit["us_per_byte"] >= 0 and fit["bytes_per_s"] > 0
        assert len(fit["median_us"]) == len(COPY_SIZES) and min(fit["median_us"]) > 0
    assert json.loads(json.dumps(costs)) == costs  # plain JSON, for a trace
    assert os.listdir(offload) == []  # the measuring store's files are gone
    (path,) = cache.iterdir()
    assert (
        path.name.startswith("copy-costs-") and json.loads(path.read_text())["format"] == "qsync-copy-costs"
    )

    again = copy_costs("cpu", offload, cache)  # read back: nothing measured
    assert again == {**costs, "source": f"cache {path}"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert copy_costs("cpu", elsewhere, cache)["source"] == "measured"  # another disk, another fit
    assert len(list(cache.iterdir())) == 2

    document = json.loads(path.read_text())
    document["costs"]["to_store"]["us_per_byte"] = -1.0
    path.write_text(json.dumps(document))
    with pytest.warns(UserWarning, match="ignoring the copy-cost cache \\(negative cost for to_store\\)"):
        assert copy_costs("cpu", offload, cache)["source"] == "measured"
    assert copy_costs("cpu", offload, cache)["source"] == f"cache {path}"  # rewritten


def test_the_fit_charges_a_files_removal_to_the_read_back_as_the_training_thread_waits_for_it(
    tmp_path, monkeypatch
):
    # autograd frees an offloaded tensor in backward, and the training thread then removes its file:
    # a removal made slow (each one waits `removal_s` more) is in every read back's time, in no write's
    removal_s = 0.05
    unlink = offload_store._unlink

    def slow_unlink(path):
        time.sleep(removal_s)
        unlink(path)

    monkeypatch.setattr(offload_store, "_unlink", slow_unlink)
    costs = fit_copy_costs("cpu", tmp_path)
    assert min(costs["from_store"]["median_us"]) >= removal_s * 1e6
    assert costs["to_store"]["median_us"][0] < removal_s * 1e6  # 64 KiB written in far less
    assert os.listdir(tmp_path) == []


def test_copy_costs_cache_sits_beside_the_cast_costs_cache_under_its_own_kind(tmp_path):
    cast = cache_path("cpu", tmp_path)
    assert os.path.basename(cast).startswith("cast-costs-")
    copy = cache_path("cpu", tmp_path, kind="copy-costs", key={"tier": "disk"})
    assert os.path.basename(copy).startswith("copy-costs-") and os.path.dirname(copy) == str(tmp_path)
    assert os.path.basename(copy)[len("copy-costs-") :] != os.path.basename(cast)[len("cast-costs-") :]
