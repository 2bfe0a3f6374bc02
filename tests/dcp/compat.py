"""What the DCP tests pass to torch versions that differ, kept light: the crash driver imports
it before forking its ranks, which must not import FSDP first."""

from __future__ import annotations

import inspect

import torch.distributed.checkpoint as dcp

# One-process saves and loads: torch 2.4 has no no_dist argument and falls back to one process
# on its own when torch.distributed is not initialised.
NO_DIST: dict[str, bool] = (
    {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {})
