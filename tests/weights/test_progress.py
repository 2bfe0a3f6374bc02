"""Progress bars: drawn when asked for, and no tqdm at all when not (a disabled tqdm still
takes a lock shared with forked children and starts a thread)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import s4weights

REPO = Path(__file__).resolve().parents[2]


def test_a_silent_save_load_and_convert_leave_no_tqdm_lock_or_thread(tmp_path) -> None:
    code = textwrap.dedent(f"""
        import io, os, threading
        import torch, tqdm
        import s4weights
        from s4weights.convert import convert
        state = {{"w": torch.randn(300, 300), "step": 3}}
        buf = io.BytesIO()
        s4weights.save(state, buf)
        s4weights.load(io.BytesIO(buf.getvalue()))
        buf = io.BytesIO()
        s4weights.save(state, buf, progress=False)
        s4weights.load(io.BytesIO(buf.getvalue()), progress=False)
        src = os.path.join({str(tmp_path)!r}, "a.pt")
        torch.save(state, src)
        convert(src, os.path.join({str(tmp_path)!r}, "a.s4w"), progress=False)
        assert not hasattr(tqdm.tqdm, "_lock"), "a tqdm lock was made"
        monitors = [t for t in threading.enumerate() if isinstance(t, tqdm._monitor.TMonitor)]
        assert not monitors, monitors
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_an_asked_for_bar_is_drawn_with_the_tensors_total(capsys) -> None:
    state = {"a": torch.randn(1000), "b": torch.zeros(10, dtype=torch.float16)}
    buf = io.BytesIO()
    s4weights.save(state, buf, progress=True)
    saved = capsys.readouterr().err
    back = s4weights.load(io.BytesIO(buf.getvalue()), progress=True)
    loaded = capsys.readouterr().err
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"], state["b"])
    for desc, err in (("s4weights save", saved), ("s4weights load", loaded)):
        assert desc in err, err
        assert "/3.93k" in err, err  # 4,020 bytes of tensors, in KiB
