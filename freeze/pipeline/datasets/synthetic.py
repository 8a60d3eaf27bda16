"""Synthetic 32x32 image classification tasks that stand in for ImageNet -> CIFAR-10 offline.

Both tasks draw on ONE bank of low-level primitives (blobs, rings, squares, crosses, oriented bars,
oriented gratings, checkers). A class is a fixed composition: three distinct primitives on three
cells of a 3x3 layout grid. The "source" task has 10 such compositions with random part colours;
the "target" task has 5 other compositions, each in two classes told apart by part colour (warm or
cool). What transfers from source to target is the early-layer vocabulary (edges, orientations,
blob and texture detectors), while the later layers, taught by the source to ignore colour, must
adapt - as with ImageNet features on CIFAR.

What makes it not trivial: in the source, part colours are random (never a class cue); the object moves
and scales, parts jitter, two distractor primitives of random kind clutter the background, the
background is a coloured low-frequency field with a gradient, and pixel noise is added.

Everything is vectorized numpy and a pure function of (task, n, seed, split): 20k images take a
few seconds on one core.
"""

from __future__ import annotations

import numpy as np

SYNTHETIC_VERSION = 1  # bump whenever the images a (task, n, seed) produces change
TASKS = ("source", "target")
PRIMITIVES = (
    "blob",
    "ring",
    "square",
    "cross",
    "bar0",
    "bar45",
    "bar90",
    "bar135",
    "grating0",
    "grating45",
    "grating90",
    "grating135",
    "checker",
)
_CELLS = ("nw", "n", "ne", "w", "c", "e", "sw", "s", "se")  # 3x3 layout grid, row-major
_COMPOSITION_SEED = 20240611  # fixed: class definitions never depend on the data seed
_PARTS = 3
_DISTRACTORS = 2
_SIZE = 32
_CELL_PX = 8.5  # grid spacing of the object's parts at scale 1
_PART_RADIUS_PX = 4.8  # primitive radius at scale 1
_NOISE_STD = 0.03  # pixel noise on the [0, 1] scale
_CHUNK = 2048  # images rendered at once (bounds memory); the noise stream is drawn per chunk
_Y, _X = np.mgrid[0:_SIZE, 0:_SIZE].astype(np.float32) + 0.5


def _compositions() -> np.ndarray:
    """[20, PARTS, 2] (primitive index, cell index): source classes 0..9, target classes 10..19.
    Every source class has its own SET of primitives; the target uses 5 other sets, each twice
    (the two classes of a pair differ only in part colour, see _PALETTES)."""
    rng = np.random.default_rng(_COMPOSITION_SEED)
    seen: set[frozenset[int]] = set()
    kind_sets = []
    while len(kind_sets) < 10 + 5:
        kinds = rng.choice(len(PRIMITIVES), _PARTS, replace=False)
        if frozenset(kinds.tolist()) not in seen:
            seen.add(frozenset(kinds.tolist()))
            kind_sets.append(kinds)
    comps = [np.stack([kinds, rng.choice(len(_CELLS), _PARTS, replace=False)], axis=1) for kinds in kind_sets]
    return np.stack(comps[:10] + [c for c in comps[10:] for _ in range(2)])


_COMPOSITIONS = _compositions()
# Part colours per class: "any" = uniformly random, so source training teaches the later layers
# to IGNORE part colour; the target's pairs are told apart only by it (warm vs cool parts). What
# transfers is then the early vocabulary, while later layers must relearn colour - freezing the
# whole backbone costs target accuracy, as with ImageNet -> CIFAR-10 (a linear probe on frozen
# source features cannot just reuse them).
_PALETTES = ("any",) * 10 + ("warm", "cool") * 5
_PALETTE_RGB = {  # (low, high) of R, G, B on the [0, 1] scale
    "warm": ((0.55, 0.2, 0.05), (0.95, 0.8, 0.45)),
    "cool": ((0.05, 0.2, 0.55), (0.45, 0.8, 0.95)),
}


def _task_classes(task: str) -> slice:
    if task not in TASKS:
        raise ValueError(f"synthetic task must be one of {', '.join(TASKS)}, got {task!r}")
    return slice(0, 10) if task == "source" else slice(10, 20)


def synthetic_class_names(task: str) -> tuple[str, ...]:
    """E.g. "ring@nw+bar45@c+checker@se" or ".../warm": the composition (and colour) of each class."""
    classes = _task_classes(task)
    return tuple(
        "+".join(f"{PRIMITIVES[k]}@{_CELLS[c]}" for k, c in comp) + ("" if palette == "any" else f"/{palette}")
        for comp, palette in zip(_COMPOSITIONS[classes], _PALETTES[classes])
    )


def _ramp(z: np.ndarray) -> np.ndarray:
    """A soft step 0 -> 1 over a quarter of a radius: anti-aliased edges without exp()."""
    return np.clip(0.5 + 4.0 * z, 0.0, 1.0)


def _primitive_alpha(kind: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Coverage in [0, 1] of one primitive at local coordinates (u, v), in units of its radius."""
    if kind == "blob":
        return np.exp(-2.5 * (u * u + v * v))
    if kind == "ring":
        return np.exp(-(((np.sqrt(u * u + v * v) - 0.72) / 0.2) ** 2))
    if kind == "square":
        return _ramp(0.75 - np.maximum(np.abs(u), np.abs(v)))
    if kind == "cross":
        inside = _ramp(1.0 - np.maximum(np.abs(u), np.abs(v)))
        return inside * np.maximum(_ramp(0.22 - np.abs(u)), _ramp(0.22 - np.abs(v)))
    if kind == "checker":
        return _ramp(0.85 - np.maximum(np.abs(u), np.abs(v))) * (np.sin(3.3 * u) * np.sin(3.3 * v) > 0)
    theta = np.deg2rad(float(kind.removeprefix("bar").removeprefix("grating")))
    along = u * np.cos(theta) + v * np.sin(theta)
    across = -u * np.sin(theta) + v * np.cos(theta)
    if kind.startswith("bar"):
        return _ramp(0.2 - np.abs(across)) * _ramp(1.0 - np.abs(along))
    # grating: stripes run along theta, i.e. the wave travels across it
    return np.exp(-1.1 * (u * u + v * v)) * (0.5 + 0.5 * np.cos(2.0 * np.pi * 1.1 * across))


def _paint(
    canvas: np.ndarray,
    kinds: np.ndarray,
    cy: np.ndarray,
    cx: np.ndarray,
    radius: np.ndarray,
    colour: np.ndarray,
    opacity: np.ndarray,
) -> None:
    """Alpha-composite one primitive per image onto ``canvas`` [n, 3, H, W], grouped by kind."""
    for k, kind in enumerate(PRIMITIVES):
        idx = np.flatnonzero(kinds == k)
        if idx.size == 0:
            continue
        u = (_X[None] - cx[idx, None, None]) / radius[idx, None, None]
        v = (_Y[None] - cy[idx, None, None]) / radius[idx, None, None]
        alpha = (_primitive_alpha(kind, u, v) * opacity[idx, None, None])[:, None]
        canvas[idx] = canvas[idx] * (1.0 - alpha) + colour[idx, :, None, None] * alpha


def _contrasting_colour(rng: np.random.Generator, background: np.ndarray) -> np.ndarray:
    """A random colour, pushed away from the background so a part is never invisible."""
    colour = rng.uniform(0.0, 1.0, background.shape).astype(np.float32)
    too_close = np.abs(colour - background).max(axis=1) < 0.35
    dark_or_light = np.where(background[too_close] > 0.5, 0.1, 0.9)
    colour[too_close] = dark_or_light * rng.uniform(0.7, 1.0, (int(too_close.sum()), 1))
    return colour


def render_synthetic_split(task: str, n: int, seed: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``n`` balanced images of ``task``: (uint8 [n, 3, 32, 32], int64 [n]). ``split`` ("train" or
    "test") selects an independent random stream, so test images never repeat training images."""
    classes = _task_classes(task)
    comps, palettes = _COMPOSITIONS[classes], np.array(_PALETTES[classes])
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = np.random.default_rng([seed, TASKS.index(task), ("train", "test").index(split)])
    labels = rng.permutation(np.arange(n) % 10).astype(np.int64)
    f32 = np.float32

    # All per-image parameters are drawn up front, so the output does not depend on _CHUNK.
    bg_base = rng.uniform(0.15, 0.85, (n, 3)).astype(f32)
    bg_lowfreq = rng.normal(0.0, 0.1, (n, 3, 4, 4)).astype(f32)
    bg_gradient = rng.normal(0.0, 0.15, (n, 2)).astype(f32)
    scale = rng.uniform(0.85, 1.15, n).astype(f32)
    centre = (_SIZE / 2 + rng.uniform(-3.0, 3.0, (n, 2))).astype(f32)
    part_jitter = rng.normal(0.0, 0.7, (n, _PARTS, 2)).astype(f32)
    part_colour = np.stack([_contrasting_colour(rng, bg_base) for _ in range(_PARTS)], axis=1)
    part_opacity = rng.uniform(0.7, 1.0, (n, _PARTS)).astype(f32)
    distractor_kind = rng.integers(0, len(PRIMITIVES), (n, _DISTRACTORS))
    distractor_pos = rng.uniform(3.0, _SIZE - 3.0, (n, _DISTRACTORS, 2)).astype(f32)
    distractor_radius = (_PART_RADIUS_PX * rng.uniform(0.4, 0.7, (n, _DISTRACTORS))).astype(f32)
    distractor_colour = np.stack([_contrasting_colour(rng, bg_base) for _ in range(_DISTRACTORS)], axis=1)
    distractor_opacity = rng.uniform(0.25, 0.6, (n, _DISTRACTORS)).astype(f32)
    noise_seed = int(rng.integers(0, 2**63))
    for palette, (low, high) in _PALETTE_RGB.items():
        chosen = palettes[labels] == palette
        part_colour[chosen] = rng.uniform(low, high, (int(chosen.sum()), _PARTS, 3))

    # bilinear upsampling matrix 4 -> 32 for the low-frequency background field
    src = np.clip((np.arange(_SIZE) + 0.5) * 4 / _SIZE - 0.5, 0, 3)
    lo = np.floor(src).astype(int).clip(0, 2)
    upsample = np.zeros((_SIZE, 4), f32)
    upsample[np.arange(_SIZE), lo] = 1 - (src - lo)
    upsample[np.arange(_SIZE), lo + 1] = src - lo

    images = np.empty((n, 3, _SIZE, _SIZE), np.uint8)
    for begin in range(0, n, _CHUNK):
        s = slice(begin, min(n, begin + _CHUNK))
        m = s.stop - s.start
        ramp = (bg_gradient[s, 0, None, None] * (_Y - 16) + bg_gradient[s, 1, None, None] * (_X - 16)) / 16
        canvas = (bg_base[s, :, None, None] + ramp[:, None] + upsample @ bg_lowfreq[s] @ upsample.T).astype(f32)
        for d in range(_DISTRACTORS):
            _paint(
                canvas,
                distractor_kind[s, d],
                distractor_pos[s, d, 0],
                distractor_pos[s, d, 1],
                distractor_radius[s, d],
                distractor_colour[s, d],
                distractor_opacity[s, d],
            )
        comp = comps[labels[s]]  # [m, PARTS, 2]
        for p in range(_PARTS):
            cell = comp[:, p, 1]
            cy = centre[s, 0] + scale[s] * (_CELL_PX * (cell // 3 - 1) + part_jitter[s, p, 0])
            cx = centre[s, 1] + scale[s] * (_CELL_PX * (cell % 3 - 1) + part_jitter[s, p, 1])
            _paint(canvas, comp[:, p, 0], cy, cx, _PART_RADIUS_PX * scale[s], part_colour[s, p], part_opacity[s, p])
        noise = np.random.default_rng([noise_seed, begin]).standard_normal((m, 3, _SIZE, _SIZE), dtype=f32)
        canvas += _NOISE_STD * noise
        images[s] = np.clip(np.rint(canvas * 255.0), 0, 255).astype(np.uint8)
    return images, labels
