"""The device's rANS normalisation (``rans_normalise`` in kernels/rans.cu) equals the CPU
reference's exact integer procedure on every histogram: ties in the remainders, counts up to
2^40, one or two symbols, all 256, sign planes given as a count of ones, empty histograms. Its
figures for the host (symbols present, size estimate, first symbol, table size) and its table
bytes equal the host's (``ranshost.estimate_many``, ``rans.table_bytes``), at two block
sizes."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from s4format.codecs import rans  # noqa: E402
from s4weights.gpu import plan, ranshost, runtime  # noqa: E402
from tests.gpu.common import histograms  # noqa: E402

pytestmark = pytest.mark.gpu


def _histograms() -> np.ndarray:
    return np.concatenate((histograms(3000, 5, (2, 10, 1000, 10**6, 1 << 40)), np.stack([
        np.eye(256, dtype=np.int64)[255], np.full(256, 1 << 40), np.zeros(256, np.int64),
        np.array([1, 1] + [0] * 254), np.array([3, 4093] + [0] * 254)])))


def test_device_normalisation_equals_the_reference() -> None:
    counts = _histograms()
    sign_n = np.array([10, 1 << 20, 7, 1 << 33, 0])
    sign_ones = np.array([3, 1, 7, 12345, 0])
    rows = counts.shape[0]
    dev = torch.from_numpy(counts.astype(np.uint64).view(np.int64)).cuda()
    ones = torch.from_numpy(sign_ones).cuda()
    base, ob = dev.data_ptr(), ones.data_ptr()
    hist = np.concatenate((base + 2048 * np.arange(rows, dtype=np.uint64),
                           np.zeros(sign_n.size, np.uint64)))
    ones_p = np.concatenate((np.zeros(rows, np.uint64), ob + 8 * np.arange(sign_n.size,
                                                                         dtype=np.uint64)))
    n = np.concatenate((np.zeros(rows, np.int64), sign_n))
    tables, (hp, op, np_, sp) = runtime.upload(hist.astype(np.uint64), ones_p.astype(np.uint64),
                                               n, ranshost.SYMBOL_BITS)
    sign = np.zeros((sign_n.size, 256), np.int64)
    sign[:, 0], sign[:, 1] = sign_n - sign_ones, sign_ones
    every = np.concatenate((counts, sign))
    stride = plan.TABLE_STRIDE
    for log2_block in (16, 5):
        out = torch.full((hist.size * 512,), 0xDEADBEEF, dtype=torch.int64, device="cuda")
        fc = out.view(torch.int32)
        stats = torch.full((hist.size * 4,), -1, dtype=torch.int64, device="cuda")
        tb = torch.full((hist.size * stride,), 0xAB, dtype=torch.uint8, device="cuda")
        bound = torch.full((hist.size,), -1, dtype=torch.int64, device="cuda")
        runtime.launch("rans", "rans_normalise", hist.size, 256, np.uint64(hp), np.uint64(op),
                       np.uint64(np_), np.uint64(sp), runtime.ptr(fc), runtime.ptr(stats),
                       runtime.ptr(tb), np.int32(log2_block),
                       runtime.constant("word_cost", ranshost.WORD_COST), runtime.ptr(bound))
        got = fc.cpu().numpy().view(np.uint32)[:hist.size * 512].reshape(-1, 512).astype(
            np.int64)
        st = stats.cpu().numpy().reshape(-1, 4)
        tbytes = tb.cpu().numpy().reshape(-1, stride)
        words = bound.cpu().numpy()
        for q, c in enumerate(every):
            want = rans.normalise(c) if c.any() else np.zeros(256, np.int64)
            assert (got[q, :256] == want).all(), q
            assert (got[q, 256:] == np.cumsum(want) - want).all(), q
            k = int(np.count_nonzero(c))
            table = rans.table_bytes(want) if k else bytes(32)
            assert tbytes[q, :len(table)].tobytes() == table, q
            if k > 1:
                est = int(ranshost.estimate_many(c[None], want[None], log2_block)[0])
            elif k == 1:
                est = ranshost.HEADER_SIZE + ranshost.n_blocks(int(c.sum()), rans.LOG2_BLOCK_MAX)
            else:
                est = ranshost.HEADER_SIZE
            # the first symbol present, and the last one (bitpack-w's width) above bit 16
            ends = int(np.argmax(c > 0)) | (255 - int(np.argmax(c[::-1] > 0))) << 16 if k else 0
            assert st[q].tolist() == [k, est, ends, len(table)], q
            # the sum the words' bound comes from (ranshost.WORD_COST)
            assert int(words[q]) == int((c * ranshost.WORD_COST[want].astype(np.int64)).sum())
    del tables
