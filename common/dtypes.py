"""The project's one dtype vocabulary: every config section that takes a dtype (``rollout.dtype``,
``scorer.dtype``, ``learner.dtype``) spells it the same way, as torch does (``float32``,
``bfloat16``), and converts it with ``torch_dtype``. Imports nothing heavy."""
from __future__ import annotations

import enum


class Dtype(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


def torch_dtype(value):
    """``Dtype`` (or its string value) -> the torch dtype."""
    import torch

    return getattr(torch, Dtype(getattr(value, "value", value)).value)
