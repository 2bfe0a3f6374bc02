"""``runtime.xor_into``: one launch XORs many byte ranges in place (a chain level's deltas),
whatever their lengths and alignments. Skipped without CUDA."""

from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from s4weights.gpu import runtime  # noqa: E402

pytestmark = pytest.mark.gpu


def test_many_ranges_of_every_length_and_alignment() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    lengths = [0, 1, 15, 16, 17, 4095, 65536, 65537, 3 * 65536 + 5, 1 << 20]
    pairs, want = [], []
    for n, (oa, ob) in zip(lengths * 3, [(0, 0)] * 10 + [(1, 0)] * 10 + [(3, 7)] * 10):
        a = torch.randint(0, 256, (n + oa,), dtype=torch.uint8, device="cuda", generator=g)[oa:]
        b = torch.randint(0, 256, (n + ob,), dtype=torch.uint8, device="cuda", generator=g)[ob:]
        want.append(a ^ b)
        pairs.append((a, b))
    runtime.xor_into(pairs)
    for (a, _b), w in zip(pairs, want):
        assert torch.equal(a, w)
    runtime.xor_into([])


def test_mismatched_ranges_are_refused() -> None:
    a = torch.zeros(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="xor of 16 bytes"):
        runtime.xor_into([(a, torch.zeros(15, dtype=torch.uint8, device="cuda"))])
    with pytest.raises(ValueError, match="on cpu"):
        runtime.xor_into([(a, torch.zeros(16, dtype=torch.uint8))])
