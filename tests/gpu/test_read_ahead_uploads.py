"""A batch staged from a read ahead (``staging.Ahead``, a chain's parent level) copies each
finished read to the device while later ones are still reading, as a batch read at staging
does; no CUDA needed (the device is emulated on the CPU, where the copies can be watched)."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import s4format  # noqa: E402
import s4weights  # noqa: E402
from s4weights.gpu import staging  # noqa: E402


@pytest.fixture
def reader(monkeypatch):
    from tests.gpu.emulated import emulate

    emulate(monkeypatch)
    monkeypatch.setattr(staging, "READ_PIECE", 4096)  # many jobs from a small file
    g = torch.Generator().manual_seed(3)
    state = {f"w{k}": (torch.randn(40_000, generator=g) * .02).bfloat16() for k in range(6)}
    b = io.BytesIO()
    s4weights.save(state, b, device="cpu")
    with s4format.Reader(b.getvalue()) as r:
        yield r


def test_reads_ahead_reach_the_device_as_they_finish(reader, monkeypatch) -> None:
    idx = list(range(len(reader.tensors)))
    made_jobs: list = []
    real_jobs, real_read = staging._jobs, staging._read_job
    real_empty = staging.runtime.device_empty
    monkeypatch.setattr(staging, "_jobs", lambda *a: made_jobs.append(real_jobs(*a))
                        or made_jobs[-1])
    hold = threading.Event()

    def read_job(r, part):  # the last read waits until the test lets it go
        if part is made_jobs[0][-1]:
            assert hold.wait(10)
        real_read(r, part)
    monkeypatch.setattr(staging, "_read_job", read_job)
    devices: list = []
    monkeypatch.setattr(staging.runtime, "device_empty",
                        lambda n: devices.append(real_empty(n)) or devices[-1])

    ahead = staging.Ahead()
    ahead.start(reader, idx)
    (_r, lay, _reads), = ahead._pending.values()
    assert len(made_jobs) == 1 and len(made_jobs[0]) >= 8
    host = lay.host_t.numpy()
    before_last = staging._end_in(host, made_jobs[0][-2][-1][1])
    staged: list = []
    t = threading.Thread(target=lambda: staged.append(staging.stage_planes(reader, idx, ahead)))
    t.start()
    try:
        # every read but the last is on the device while the last one is still held back
        seen = False
        for _ in range(500):
            seen = bool(devices) and np.array_equal(devices[0].numpy()[:before_last],
                                                    host[:before_last])
            if seen:
                break
            time.sleep(0.01)
        assert seen and not staged
    finally:
        hold.set()
        t.join(10)
    st = staged[0]
    assert np.array_equal(st.device.numpy(), st.host)  # and then all of it
    want = np.frombuffer(reader.source.read_at(0, reader.source.size()), np.uint8)
    for q, (_k, _j, plane) in enumerate(st.planes):
        a = int(st.at[q])
        assert np.array_equal(st.host[a:a + plane.stored_len],
                              want[plane.offset:plane.offset + plane.stored_len])
    ahead.drop()
    assert staging._AHEAD.held == 0
