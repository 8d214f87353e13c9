"""Small masked-tensor helpers shared by the correction modules (private)."""
from __future__ import annotations

import torch
from torch import Tensor


def check_shape(name: str, x: Tensor, shape: tuple[int, ...] | torch.Size) -> None:
    """Raise ValueError naming ``name`` unless ``x`` has exactly ``shape``."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(shape)}")


def as_mask(mask: Tensor, like: Tensor, name: str = "mask") -> Tensor:
    """Return ``mask`` as a bool tensor with ``like``'s shape (anything > 0 counts as valid)."""
    check_shape(name, mask, like.shape)
    return mask if mask.dtype == torch.bool else mask > 0


def check_finite(name: str, x: Tensor, valid: Tensor | None = None) -> None:
    """Raise ValueError naming ``name`` if ``x`` has NaN/inf where ``valid`` (default: anywhere).

    Positions outside ``valid`` (padding) are not checked: they never count.
    """
    bad = ~torch.isfinite(x)
    if valid is not None:
        bad = bad & valid
    if bool(bad.any()):
        n_nan = int((torch.isnan(x) & bad).sum())
        n_inf = int(bad.sum()) - n_nan
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} has non-finite values at valid positions: {n_nan} NaN, "
                         f"{n_inf} inf (first at index {where})")


def zero_outside(x: Tensor, valid: Tensor) -> Tensor:
    """``x`` where ``valid`` else 0; unlike ``x * valid`` this stays finite for NaN padding and
    passes no gradient to the padded positions."""
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, valid: Tensor, dim: int | None = None) -> Tensor:
    z = zero_outside(x, valid)
    return z.sum() if dim is None else z.sum(dim)


def masked_mean(x: Tensor, valid: Tensor, dim: int | None = None, empty: float = 0.0) -> Tensor:
    """Mean of ``x`` over ``valid``; ``empty`` where there is no valid element."""
    n = valid.sum() if dim is None else valid.sum(dim)
    s = masked_sum(x, valid, dim)
    return torch.where(n > 0, s / n.clamp(min=1), torch.full_like(s, empty))


def masked_quantile(x: Tensor, valid: Tensor, q: float, empty: float = 0.0) -> float:
    """Linear-interpolated ``q``-quantile of ``x[valid]`` (sort-based: no size limit)."""
    v = x[valid].detach().double().flatten()
    if v.numel() == 0:
        return empty
    v, _ = torch.sort(v)
    pos = q * (v.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def masked_min(x: Tensor, valid: Tensor, empty: float = 0.0) -> float:
    v = x[valid]
    return float(v.min()) if v.numel() else empty


def masked_max(x: Tensor, valid: Tensor, empty: float = 0.0) -> float:
    v = x[valid]
    return float(v.max()) if v.numel() else empty


def frac(count: Tensor | int, total: Tensor | int) -> float:
    """count / total as a float, 0 when total is 0."""
    t = float(total)
    return float(count) / t if t > 0 else 0.0
