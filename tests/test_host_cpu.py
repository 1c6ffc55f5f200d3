"""`host_cpu`: the CPU's model name and precision extensions, read from cpuinfo files written here
as Linux writes them, and the per-machine caches they key."""

import platform
from pathlib import Path

from qsync_callback import host_cpu
from qsync_callback.lp.costs import cache_key, cache_path, device_name
from qsync_callback.recorder.op_dataset import dataset_path

BF16_FLAGS = "fpu sse2 avx fma f16c avx2 avx512f avx512bw avx512_vnni avx512_bf16 vaes"
PLAIN_FLAGS = "fpu sse2 avx fma f16c avx2 vaes"


def cpuinfo(tmp_path: Path, name: str, flags: str) -> Path:
    """A two-processor cpuinfo, the fields in the order Linux writes them."""
    block = (
        f"processor\t: {{n}}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
        f"model name\t: {name}\nstepping\t: 1\nflags\t\t: {flags}\nbugs\t\t: sysret_ss_attrs\n\n"
    )
    path = tmp_path / f"cpuinfo-{len(flags)}"
    path.write_text(block.format(n=0) + block.format(n=1))
    return path


def test_two_cpus_of_one_name_are_told_apart_by_their_extensions(tmp_path):
    bf16 = cpuinfo(tmp_path, "AMD EPYC", BF16_FLAGS)
    plain = cpuinfo(tmp_path, "AMD EPYC", PLAIN_FLAGS)
    assert host_cpu.cpu_name(bf16) == host_cpu.cpu_name(plain) == "AMD EPYC"
    assert host_cpu.precision_flags(bf16) == ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni")
    assert host_cpu.precision_flags(plain) == ("avx2", "fma", "f16c")
    assert host_cpu.cpu_description(bf16) == "AMD EPYC (avx2 fma f16c avx512f avx512_bf16 avx512_vnni)"
    assert host_cpu.cpu_description(plain) == "AMD EPYC (avx2 fma f16c; no AVX-512)"


def test_a_cpuinfo_without_flags_or_name_says_so(tmp_path):
    """An ARM kernel's cpuinfo names no model and lists no x86 flags; a missing file names nothing:
    the name is then Python's for the machine."""
    bare = tmp_path / "cpuinfo"
    bare.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nmodel name\t:\nFeatures\t: fp asimd\n")
    assert host_cpu.precision_flags(bare) == ()
    fallback = platform.processor() or platform.machine() or "unknown cpu"
    assert host_cpu.cpu_name(bare) == host_cpu.cpu_name(tmp_path / "absent") == fallback
    assert host_cpu.cpu_description(bare) == f"{fallback} (no vector extensions listed)"


def test_the_per_machine_caches_are_not_shared_between_them(tmp_path, monkeypatch):
    """A cache dir shared by two VMs of one model name (a home on NFS): each keeps its own cast
    costs and op data set."""
    paths = []
    for flags in (BF16_FLAGS, PLAIN_FLAGS):
        monkeypatch.setattr(host_cpu, "CPUINFO", cpuinfo(tmp_path, "AMD EPYC", flags))
        assert cache_key("cpu")["device"] == f"cpu: {host_cpu.cpu_description()}"
        paths.append((cache_path("cpu", tmp_path), dataset_path("cpu", tmp_path)))
    assert paths[0][0] != paths[1][0] and paths[0][1] != paths[1][1]


def test_torch_and_tf_runs_name_the_cpu_alike():
    """Both integrations' fingerprints name the device as the caches do (TF: on a machine with no GPU)."""
    from qsync_callback.integrations.horovod_tf.horovod_run import tf_device_name

    assert tf_device_name() == device_name("cpu") == f"cpu: {host_cpu.cpu_description()}"


def test_every_precision_extension_of_a_recent_xeon_is_named_in_a_fixed_order(tmp_path):
    """A cpuinfo naming every precision extension (AMX with fp16, AVX-NE-CONVERT) among others, in an
    order other than `PRECISION_FLAGS`': the list comes out in that fixed order, spelled here apart
    from it so that a misspelled entry there fails."""
    flags = (
        "fpu sse2 avx f16c fma avx2 avx512f avx512dq avx512bw avx_vnni avx512_bf16 amx_bf16 "
        "avx512_vnni avx512_fp16 amx_tile amx_int8 avx_ne_convert amx_fp16 avx512_vp2intersect"
    )
    xeon = cpuinfo(tmp_path, "Intel(R) Xeon(R)", flags)
    assert host_cpu.precision_flags(xeon) == (
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512_bf16",
        "avx512_fp16",
        "avx512_vnni",
        "avx_vnni",
        "avx_ne_convert",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
        "amx_fp16",
    )


def test_the_largest_cache_is_read_from_sysfs_sizes_as_linux_writes_them(tmp_path):
    for index, size in enumerate(("32K", "32K", "1024K", "32768K", "unknown")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(f"{size}\n")
    assert host_cpu.largest_cache_bytes(tmp_path) == 32 * 2**20
    (tmp_path / "index5").mkdir()
    (tmp_path / "index5" / "size").write_text("1M\n")
    assert host_cpu.largest_cache_bytes(tmp_path) == 32 * 2**20
    assert host_cpu.largest_cache_bytes(tmp_path / "none") is None


def test_a_size_without_a_unit_is_bytes_and_an_unreadable_one_is_skipped(tmp_path):
    (tmp_path / "index0" / "size").mkdir(parents=True)  # read as a file: an OSError
    (tmp_path / "index1").mkdir()
    (tmp_path / "index1" / "size").write_text("1024K\n")
    (tmp_path / "index2").mkdir()
    (tmp_path / "index2" / "size").write_text("67108864\n")
    assert host_cpu.largest_cache_bytes(tmp_path) == 64 * 2**20
