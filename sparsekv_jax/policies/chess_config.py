"""CHESS's options (`sparsekv_jax.policies.chess`): the ratio presets, the allowed values of its
string options, the checks of a policy's fields, and the trigger thresholds of a `sparsekv
calibrate` file (a path, or one shipped in ``policies/calibration/``).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparsekv_jax.policies.chess import CHESS

PRESETS = {"conservative": (0.9, 0.9, 0.9), "moderate": (0.8, 0.7, 0.7), "aggressive": (0.5, 0.2, 0.1)}
TRIGGERS = ("uncertainty", "interval")
TRIGGER_ON = ("both", "either")
KEYS = ("post_rope", "pre_rope")
CALIBRATION_DIR = os.path.join(os.path.dirname(__file__), "calibration")


def check_fields(pol: CHESS) -> None:
    """`CHESS.__post_init__`: a preset name becomes its ratios (``pol`` is frozen: set in place); any
    bad field raises ``ValueError`` naming it."""
    if isinstance(pol.ratios, str):
        if pol.ratios not in PRESETS:
            raise ValueError(f"ratios={pol.ratios!r}: unknown preset; choose from {', '.join(PRESETS)}")
        object.__setattr__(pol, "ratios", PRESETS[pol.ratios])
    ratios = tuple(float(r) for r in pol.ratios) if isinstance(pol.ratios, (tuple, list)) else None
    if ratios is None or len(ratios) != 3 or not all(0.0 < r <= 1.0 for r in ratios):
        raise ValueError(f"ratios={pol.ratios!r} must be three fractions in (0, 1] (ρ_g, ρ_c, ρ_p)")
    object.__setattr__(pol, "ratios", ratios)
    for name in ("page_size", "chunk_pages", "grid_chunks", "interval"):
        value = getattr(pol, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if pol.page_size & (pol.page_size - 1):
        raise ValueError(f"page_size={pol.page_size} must be a power of two")
    for name in ("sink_pages", "window_pages", "max_backtracks", "next_pages"):
        value = getattr(pol, name)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0")
    if pol.window_pages < 1:
        raise ValueError(f"window_pages={pol.window_pages} must be >= 1 (the anchor is the window's mean)")
    if pol.keys not in KEYS:
        raise ValueError(f"keys={pol.keys!r} must be one of {KEYS}")
    if not isinstance(pol.centred, bool):
        raise ValueError(f"centred={pol.centred!r} must be a bool")
    if pol.trigger not in TRIGGERS:
        raise ValueError(f"trigger={pol.trigger!r} must be one of {TRIGGERS}")
    if pol.trigger_on not in TRIGGER_ON:
        raise ValueError(f"trigger_on={pol.trigger_on!r} must be one of {TRIGGER_ON}")
    if not isinstance(pol.regenerate, bool):
        raise ValueError(f"regenerate={pol.regenerate!r} must be a bool")
    for name in ("entropy_threshold", "varentropy_threshold"):
        value = getattr(pol, name)
        if isinstance(value, (int, float)) and not value >= 0:
            raise ValueError(f"{name}={value} must be >= 0")


def load_thresholds(calibration: str) -> dict[str, float]:
    """``{"entropy_threshold", "varentropy_threshold"}`` from a `sparsekv calibrate` JSON file."""
    path = calibration
    if not os.path.exists(path):
        shipped = os.path.join(CALIBRATION_DIR, f"{calibration}.json")
        if not os.path.exists(shipped):
            raise ValueError(f"calibration={calibration!r}: no such file, and no shipped calibration of that name")
        path = shipped
    with open(path) as f:
        data = json.load(f)
    try:
        return {"entropy_threshold": float(data["entropy_threshold"]),
                "varentropy_threshold": float(data["varentropy_threshold"])}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"calibration file {path} lacks entropy_threshold/varentropy_threshold: {e}") from None
