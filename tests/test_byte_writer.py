"""async_mode="bytes": DCP serializes on a thread, a process without torch writes, checksums and sums the
bytes: the same files, checksums and fingerprint as thread mode, each staging buffer sent once and released
when freed, a killed writer replaced, its errors reported with their errno."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch

from ckpt_core import CheckpointManager, TrainState
from ckpt_core import byte_client, byte_writer, dcp_io
from ckpt_core.manifest import parse_manifest
from ckpt_core.shared_arena import ARENA
from ckpt_core.sidecar import SIDECAR_SUFFIX, parse_sidecar
from conftest import WORKERS, run_script

KEY = "a signing key of the bytes tests"


def _model(seed: int = 1) -> torch.nn.Module:
    """Float tensors of every dtype the writer sums (large enough to travel as references), an int64 one
    and a transposed view (written by reference, summed here), small ones (inline bytes), a tied weight."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    model.register_buffer("w32", torch.randn(512, 1024, generator=g))
    model.register_buffer("bf", torch.randn(384, 1024, generator=g).to(torch.bfloat16))
    model.register_buffer("h16", torch.randn(300, 1000, generator=g).to(torch.float16))
    model.register_buffer("f64", torch.randn(70_001, generator=g).to(torch.float64))
    model.register_buffer("ids", torch.randint(0, 9, (300_000,), generator=g))
    model.register_buffer("tr", torch.randn(1024, 512, generator=g).t())
    model.register_buffer("small", torch.randn(100, generator=g))
    model.lin = torch.nn.Linear(256, 256)
    model.tied = model.lin
    return model


def _save(root: Path, mode: str, model: torch.nn.Module, steps=(1,), **kwargs) -> Path:
    with CheckpointManager(str(root), async_mode=mode, lease=False, handle_preemption=False, **kwargs) as m:
        for step in steps:
            m.save(step, TrainState(model=model))
            m.wait()
    return root / f"step_{steps[-1]:09d}"


def _restored_equal(root: Path, model: torch.nn.Module, step: int, **kwargs) -> bool:
    fresh = _model(seed=99)
    with CheckpointManager(str(root), async_mode="off", lease=False, handle_preemption=False, **kwargs) as m:
        assert m.restore(TrainState(model=fresh), step=step).step == step
    return all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())


def _sidecars(step: Path) -> list:
    return [parse_sidecar(p.read_bytes()) for p in sorted(step.glob(f"*{SIDECAR_SUFFIX}"))]


def _counting_local_sums(monkeypatch) -> list:
    summed: list = []
    real = dcp_io.fp.tensor_entry
    monkeypatch.setattr(dcp_io.fp, "tensor_entry", lambda t, *a, **k: summed.append(t.shape) or real(t, *a, **k))
    return summed


@pytest.mark.parametrize("direct_io", [True, False])
def test_bytes_mode_writes_the_files_checksums_and_fingerprint_of_thread_mode(tmp_path, monkeypatch, direct_io):
    model = _model()
    thread = _save(tmp_path / "thread", "thread", model, direct_io=direct_io)
    summed = _counting_local_sums(monkeypatch)
    remote = _save(tmp_path / "bytes", "bytes", model, direct_io=direct_io)
    # the byte writer summed the large float tensors; summed here: int64, the transposed view (DCP writes a
    # copy), the small ones (inline bytes) and the tied weight's second name (the writer sums it once)
    assert sorted(summed) == sorted([torch.Size([300_000]), torch.Size([512, 1024]), torch.Size([100]),
                                     torch.Size([256]), torch.Size([256]), torch.Size([256, 256])])
    data = sorted(p.name for p in thread.glob("*.distcp"))
    assert data and data == sorted(p.name for p in remote.glob("*.distcp"))
    for name in data:
        assert (thread / name).read_bytes() == (remote / name).read_bytes(), name
    a, b = parse_manifest((thread / "manifest.json").read_bytes()), parse_manifest((remote / "manifest.json").read_bytes())
    assert a.fingerprint == b.fingerprint
    assert {n: a.files[n] for n in data} == {n: b.files[n] for n in data}
    assert [s.items for s in _sidecars(thread)] == [s.items for s in _sidecars(remote)]
    assert _restored_equal(tmp_path / "bytes", model, 1)


def test_a_signed_bytes_save_records_each_items_sha256(tmp_path):
    model = _model()
    thread = _save(tmp_path / "thread", "thread", model, signing_key=KEY)
    remote = _save(tmp_path / "bytes", "bytes", model, signing_key=KEY)
    digests = [s.item_sha256 for s in _sidecars(remote)]
    assert digests == [s.item_sha256 for s in _sidecars(thread)] and all(digests)
    assert _restored_equal(tmp_path / "bytes", model, 1, signing_key=KEY)


def test_the_byte_writer_process_runs_without_torch(tmp_path):
    _save(tmp_path, "bytes", _model())
    modules = byte_client.PROCESS.request("ping").result(30)["modules"]
    assert "ckpt_core.byte_writer" in modules and "numpy" in modules
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")]


def _staging_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "memfd:ckpt-staging" in line)


def test_each_staging_buffer_goes_over_once_and_is_released_when_freed(tmp_path, monkeypatch):
    sent: list = []
    real = byte_client.send_message
    monkeypatch.setattr(byte_client, "send_message",
                        lambda sock, msg, fds=(): sent.append((msg[0], msg[1], len(fds))) or real(sock, msg, fds))
    model = _model()
    chunks_before = ARENA.chunks()
    m = CheckpointManager(str(tmp_path), async_mode="bytes", lease=False, handle_preemption=False)
    state = TrainState(model=model)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.w32.add_(1.0)
        m.save(step, state)
        m.wait()
        if step == 1:
            maps = [(tokens, fds) for kind, tokens, fds in sent if kind == "map"]
            sent.clear()
    # one message, one descriptor per arena chunk the staged tensors lie in (here all in one)
    assert [fds for _, fds in maps] == [len(maps[0][0])] == [ARENA.chunks() - chunks_before] == [1]
    assert not [s for s in sent if s[0] in ("map", "release")]  # saves 2 and 3 reuse them
    pid = byte_client.PROCESS.pid
    assert _staging_mappings(pid) == len(maps[0][0])
    m.close()
    assert ARENA.chunks() == chunks_before
    released = [t for kind, tokens, _ in sent if kind == "release" for t in tokens]
    assert sorted(released) == sorted(t for t, _size in maps[0][0])
    deadline = time.monotonic() + 10
    while _staging_mappings(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _staging_mappings(pid) == 0
    assert _restored_equal(tmp_path, model, 3)


def _write_message_bytes(monkeypatch) -> list:
    sizes: list = []
    real = byte_client.send_message

    def spy(sock, msg, fds=()):
        if msg[0] == "write":
            sizes.append(len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)))
        return real(sock, msg, fds)

    monkeypatch.setattr(byte_client, "send_message", spy)
    return sizes


def test_under_the_file_system_sharing_strategy_staged_tensors_still_go_by_reference(tmp_path, monkeypatch):
    """torch's file_system strategy shares memory without descriptors; the arena does not depend on it."""
    model = _model()
    state_bytes = sum(t.nbytes for t in model.state_dict().values())
    sizes = _write_message_bytes(monkeypatch)
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        remote = _save(tmp_path / "bytes", "bytes", model)
    finally:
        torch.multiprocessing.set_sharing_strategy(old)
    assert sizes and sum(sizes) < state_bytes / 50  # headers and the tensors under a page, not every byte
    thread = _save(tmp_path / "thread", "thread", model)
    data = sorted(p.name for p in thread.glob("*.distcp"))
    assert data and all((thread / n).read_bytes() == (remote / n).read_bytes() for n in data)
    assert _restored_equal(tmp_path / "bytes", model, 1)


def test_a_state_of_thousands_of_tensors_holds_a_few_descriptors(tmp_path, monkeypatch):
    """One descriptor per arena chunk, not one per staged tensor (a limit of 1,024 open files is common)."""
    model = torch.nn.Module()
    g = torch.Generator().manual_seed(3)
    for i in range(2000):
        model.register_buffer(f"b{i}", torch.randn(2048, generator=g))  # 8 KiB each: staged by reference
    sizes = _write_message_bytes(monkeypatch)
    before = len(os.listdir("/proc/self/fd"))
    with CheckpointManager(str(tmp_path), async_mode="bytes", lease=False, handle_preemption=False) as m:
        m.save(1, TrainState(model=model))
        m.wait()
        during = len(os.listdir("/proc/self/fd"))
    assert during - before <= 16
    assert sum(sizes) < 2000 * 8192 / 2  # torch.save's headers (about 1.6 KiB a tensor), not the tensors
    fresh = torch.nn.Module()
    for i in range(2000):
        fresh.register_buffer(f"b{i}", torch.zeros(2048))
    with CheckpointManager(str(tmp_path), async_mode="off", lease=False, handle_preemption=False) as m:
        m.restore(TrainState(model=fresh), step=1)
    assert all(torch.equal(fresh.get_buffer(k), v) for k, v in model.named_buffers())


def test_a_byte_writer_killed_between_or_during_saves_is_replaced(tmp_path, monkeypatch):
    model = _model()
    m = CheckpointManager(str(tmp_path), async_mode="bytes", lease=False, handle_preemption=False,
                          retry_backoff_s=0.01)
    state = TrainState(model=model)
    m.save(1, state)
    m.wait()
    first = byte_client.PROCESS.pid
    os.kill(first, signal.SIGKILL)
    with torch.no_grad():
        model.w32.add_(1.0)
    m.save(2, state)  # the dead process is found at the next request and replaced
    m.wait()
    second = byte_client.PROCESS.pid
    assert second != first
    real_hold, real_request, killed, writes = (byte_client.ByteWriterProcess.hold,
                                               byte_client.ByteWriterProcess.request, [], [])

    def kill_after_mapping(self, storages):
        generation = real_hold(self, storages)
        if not killed:  # the recipes then name buffers of a process that is gone
            killed.append(self.pid)
            os.kill(self.pid, signal.SIGKILL)
            self._proc.wait()
        return generation

    def count_writes(self, kind, *args, **kwargs):
        if kind == "write":
            writes.append(self.pid)
        return real_request(self, kind, *args, **kwargs)

    monkeypatch.setattr(byte_client.ByteWriterProcess, "hold", kill_after_mapping)
    monkeypatch.setattr(byte_client.ByteWriterProcess, "request", count_writes)
    with torch.no_grad():
        model.w32.add_(1.0)
    m.save(3, state)  # its first attempt fails with the process; the retry maps every buffer again
    m.wait()
    m.close()
    assert killed == [second] and byte_client.PROCESS.pid not in (first, second)
    files = len(list((tmp_path / "step_000000003").glob("*.distcp")))
    assert len(writes) > files  # the files of the first attempt were asked for, then all of them again
    assert [r.step for r in m.list()] == [1, 2, 3]
    assert _restored_equal(tmp_path, model, 3)


def test_an_error_in_the_byte_writer_comes_back_with_its_errno(tmp_path):
    path = tmp_path / "read_only"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    spec = {"direct": False, "sync": True, "sha256": False, "nice": 0, "segments": [[b"some bytes"]]}
    try:
        fut = byte_client.PROCESS.request("write", spec, fds=(fd,))
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        fut.result(30)
    assert err.value.errno == 9 and "Bad file descriptor" in str(err.value)  # EBADF: not open for writing
    assert byte_client.PROCESS.request("ping").result(30)["pid"] == byte_client.PROCESS.pid  # still serving


def test_sums_fed_in_slices_are_the_bits_of_one_pass():
    import numpy as np

    from ckpt_core import array_sums

    a = np.random.default_rng(0).standard_normal(5 * array_sums.CHUNK + 123).astype(np.float32)
    acc = array_sums.SumsCrc(a.dtype, a.size)
    step = byte_writer.CHUNK // a.itemsize
    for pos in range(0, a.size, step):
        acc.update(a[pos : pos + step])
    assert (acc.s, acc.sa, acc.crc) == array_sums.sums_crc(a)


@pytest.mark.parametrize("direct", [True, False])
def test_a_tensor_of_many_slices_is_written_whole_in_order_with_its_crc_and_sums(tmp_path, direct):
    """Summing a slice overlaps writing the one before (a second thread); the file holds every byte in order."""
    import mmap

    import crc32c
    import numpy as np

    from ckpt_core import array_sums

    header = b"h" * 100
    a = np.random.default_rng(1).standard_normal(3 * byte_writer.CHUNK // 4 + 5000).astype(np.float32)
    fd = os.memfd_create("test-slices")
    os.ftruncate(fd, a.nbytes)
    with mmap.mmap(fd, a.nbytes) as rw:
        rw[:] = a.tobytes()
    maps = {7: mmap.mmap(fd, a.nbytes, prot=mmap.PROT_READ)}
    os.close(fd)
    out_fd, _direct = byte_client.open_data_file(str(tmp_path / "f"), direct)
    spec = {"direct": _direct, "sync": True, "sha256": True,
            "segments": [[header, (7, 0, a.nbytes, "float32", 3)]]}
    result = byte_writer.write_file(out_fd, spec, maps)
    data = (tmp_path / "f").read_bytes()
    assert data == header + a.tobytes()
    assert result["segments"] == [(0, len(data), crc32c.crc32c(data))]
    assert result["sums"] == {3: array_sums.sums_crc(a, with_crc=False)[:2]}
    import hashlib

    assert result["sha256"] == {0: hashlib.sha256(data).hexdigest()}
    maps[7].close()


def test_a_failed_slice_write_stops_the_tensor_and_raises_its_error():
    import numpy as np

    class Sink:
        def __init__(self):
            self.parts = []

        def write_crc(self, b, crc):
            if len(self.parts) == 2:
                raise OSError(28, "No space left on device")
            self.parts.append(bytes(memoryview(b).cast("B")))
            return len(self.parts[-1]), None

    a = np.arange(5 * byte_writer.CHUNK // 4, dtype=np.float32)
    sink = Sink()
    with pytest.raises(OSError) as err:
        byte_writer._write_summed(sink, memoryview(a.tobytes()), "float32", 0, None)
    assert err.value.errno == 28
    step = byte_writer.CHUNK
    assert sink.parts == [a.tobytes()[:step], a.tobytes()[step : 2 * step]]  # in order, none after the error


@pytest.mark.timeout(300)
def test_four_ranks_bytes_mode_files_match_thread_mode_and_restore_exactly(tmp_path):
    run_script(WORKERS / "bytes_worker.py", [str(tmp_path)], nproc=4, timeout=280)
    steps = {mode: tmp_path / mode / "step_000000003" for mode in ("thread", "bytes")}
    data = sorted(p.name for p in steps["thread"].glob("*.distcp"))
    assert len({name.split("_")[2] for name in data}) == 4  # every rank wrote its own files
    assert data == sorted(p.name for p in steps["bytes"].glob("*.distcp"))
    for name in data:
        assert (steps["thread"] / name).read_bytes() == (steps["bytes"] / name).read_bytes(), name
    manifests = {mode: parse_manifest((p / "manifest.json").read_bytes()) for mode, p in steps.items()}
    assert manifests["thread"].fingerprint == manifests["bytes"].fingerprint
    results = sorted((tmp_path / "results").glob("rank*.txt"))
    assert [p.read_text().split()[0] for p in results] == ["exact"] * 4
    pids = {p.read_text().split()[1] for p in results}
    assert len(pids) == 4  # one byte writer process per rank


def test_the_byte_writer_exits_with_the_training_process_while_a_fork_holds_its_socket(tmp_path):
    proc = run_script(WORKERS / "bytes_orphan_worker.py", [str(tmp_path)], expect_rc=-signal.SIGKILL)
    writer, fork, group = proc.stdout.split()
    writer, fork = int(writer), int(fork)
    assert group == "False"  # one process: bytes mode starts no process group
    try:
        deadline = time.monotonic() + 10
        while _running(writer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(writer)
        assert _running(fork)  # the fork still holds the socket: the writer left on its own
    finally:
        os.kill(fork, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
