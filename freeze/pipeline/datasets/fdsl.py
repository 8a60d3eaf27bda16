"""FDSL-32: a formula-driven source -> target pair for offline transfer (docs/substrate.md; research
note substrate.md, section 5), in the spirit of FractalDB (Kataoka et al.) and Anderson & Farrell.

A class is one iterated function system (IFS) of 2-4 contractive affine maps, each map
``R(theta) diag(s1, +-s2) R(phi)`` with singular values below 1 (Anderson & Farrell's SVD
parameterisation), kept only when its attractor covers 5-60 % of the canvas. The "source" task has
128 such classes; the "target" task has 10 further ones, drawn from a separate stream and never seen
in pretraining: new classes of the same grammar, so early layers (edges, colour, density texture)
transfer while the head and the top stage must adapt.

An image: the class's maps perturbed per instance (angles, singular values, offsets: 1p-frac
style), rendered by the chaos game at 64 px and area-averaged to 32 px, at a random rotation,
flip, scale (0.55-0.95 of the canvas) and position; coloured from a class-specific hue for about
70 % of the classes (hue jitter 0.08; the rest draw any hue: shape-only classes) and shaded by point
density; on a dead-leaves background (discs and squares, radius density ~ r^-3, Baradad et al.),
low-pass filtered, with 0-2 faint distractor fractals of other classes of the same task, and pixel
noise. Colour is thus informative in the source, as on ImageNet, and the target is not told apart
by colour alone.

Everything is vectorised numpy and a pure function of (task, n, seed, split).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

FDSL_VERSION = 1  # bump whenever the images a (task, n, seed, split) produces change
TASKS = ("source", "target", "fine", "pale", "muted", "mix", "size", "place")
NUM_SOURCE_CLASSES = 128
NUM_TARGET_CLASSES = 10
_SYSTEM_SEEDS = {"source": 20261123, "target": 20261124}  # class definitions never depend on the data seed
_SIZE = 32
_RENDER = 64  # chaos game resolution; 2x2 area average -> 32
_POINTS = 2500
_DISTRACTOR_POINTS = 800
_BURN_IN = 12
_LEAVES = 32
_NOISE_STD = 0.03
_CHUNK = 1024  # images rendered at once (bounds memory); per-chunk streams are seeded by (seed, chunk)
_COVERAGE = (0.05, 0.60)
_SHAPE_ONLY_SHARE = 0.3
_HUE_JITTER = 0.08


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"FDSL-32 task must be one of {', '.join(TASKS)}, got {task!r}")


# "fine": the target's systems 0-5 as six classes, and systems 6 and 7 each split into two classes
# whose maps differ by +-delta from the system's: a fine distinction of the kind the source's
# instance perturbations (std 0.08 rad, 0.03, 0.05) taught the top layers to ignore. delta is this
# many instance-perturbation stds per parameter, drawn once per system.
_FINE_DELTA = 1.5
_FINE_SEED = 20261125
# "pale": the target's systems 0-4, each in two classes told apart only by the object's colour
# saturation, vivid (0.8-1.0) or pale (0.1-0.3): a cue that is a nuisance in every source class
# (saturation 0.5-1.0 at random), simple for early layers, which the source's top may discard.
_PALE_SATURATION = ((0.8, 1.0), (0.1, 0.3))  # class 2i, class 2i + 1
# "muted": as "pale", with both saturation ranges inside the source's 0.5-1.0 (no pixel-level shift:
# the cue is only a nuisance of the source, not out of its distribution).
_SATURATION = {"pale": _PALE_SATURATION, "muted": ((0.85, 1.0), (0.5, 0.65))}
# "mix": six held-out systems as six classes (saturation as in the source), and two more each in a
# vivid and a muted class: the share of classes that hinge on the source nuisance (4 of 10) sets how
# much the frozen top can lose, the knob that scales the deep-freezing cost.
_MIX_SATURATION = ((0.5, 1.0),) * 6 + ((0.85, 1.0), (0.5, 0.65)) * 2
# "size" and "place": the "mix" layout (six held-out systems, two more each split in two classes) with
# a cue that early layers keep spatially while the source's globally pooled top is trained to
# discard it (the source draws scale and position at random): the object's size (large 0.8-0.95
# of the canvas or small 0.55-0.7, both inside the source's 0.55-0.95) or its place (small, pushed to
# the top or the bottom of the canvas; vertical, so the study's horizontal flips keep it).
# Looked for: a probe gap that stays flat through layer2 and opens in layer3-4 (docs/substrate.md).
_SIZE_SCALE = ((0.55, 0.95),) * 6 + ((0.8, 0.95), (0.55, 0.7)) * 2
_PLACE = (0,) * 6 + (-1, 1) * 2  # -1 top, +1 bottom, 0 anywhere
_PLACE_SCALE = (0.55, 0.7)
_SPLIT_TASKS = ("mix", "size", "place")


def num_classes(task: str) -> int:
    _check_task(task)
    return NUM_SOURCE_CLASSES if task == "source" else NUM_TARGET_CLASSES


# ------------------------------------------------------------------------------------ the classes
def _maps(params: np.ndarray) -> np.ndarray:
    """[..., 7] (theta, phi, s1, s2, sign, bx, by) -> [..., 6] (a00, a01, a10, a11, bx, by)."""
    theta, phi, s1, s2, sign, bx, by = np.moveaxis(params, -1, 0)
    ct, st, cp, sp = np.cos(theta), np.sin(theta), np.cos(phi), np.sin(phi)
    s2 = s2 * sign
    # R(theta) @ diag(s1, s2) @ R(phi)
    a00 = ct * s1 * cp - st * s2 * sp
    a01 = -ct * s1 * sp - st * s2 * cp
    a10 = st * s1 * cp + ct * s2 * sp
    a11 = -st * s1 * sp + ct * s2 * cp
    return np.stack([a00, a01, a10, a11, bx, by], axis=-1)


def _map_probabilities(params: np.ndarray, active: np.ndarray) -> np.ndarray:
    """[..., K] cumulative choice probabilities, proportional to |det| (floored), 0 for padding maps."""
    weight = np.maximum(params[..., 2] * params[..., 3], 0.02) * active
    return np.cumsum(weight / weight.sum(-1, keepdims=True), axis=-1)


def _chaos_game(maps: np.ndarray, cum_p: np.ndarray, points: int, rng: np.random.Generator) -> np.ndarray:
    """[m, points, 2] attractor points of m systems (maps [m, K, 6], cum_p [m, K]), after a burn-in."""
    m = maps.shape[0]
    u = rng.random((points + _BURN_IN, m), dtype=np.float32)
    choice = (u[:, :, None] > cum_p[None].astype(np.float32)).sum(-1).clip(0, maps.shape[1] - 1)
    rows = np.arange(m)
    coef = maps.astype(np.float32)
    x = np.zeros(m, np.float32)
    y = np.zeros(m, np.float32)
    out = np.empty((m, points, 2), np.float32)
    for t in range(points + _BURN_IN):
        c = coef[rows, choice[t]]
        x, y = c[:, 0] * x + c[:, 1] * y + c[:, 4], c[:, 2] * x + c[:, 3] * y + c[:, 5]
        if t >= _BURN_IN:
            out[:, t - _BURN_IN, 0] = x
            out[:, t - _BURN_IN, 1] = y
    return out


def _normalise(pts: np.ndarray) -> np.ndarray:
    """Centre each attractor on its bounding box and scale its longer side to 1: [-0.5, 0.5]."""
    lo, hi = pts.min(1, keepdims=True), pts.max(1, keepdims=True)
    extent = np.maximum((hi - lo).max(-1, keepdims=True), 1e-6)
    return (pts - (lo + hi) / 2) / extent


def _histogram(px: np.ndarray, res: int) -> np.ndarray:
    """[m, P, 2] pixel coordinates (x, y) -> [m, res, res] point counts (outside points dropped)."""
    m = px.shape[0]
    ix, iy = np.floor(px[..., 0]).astype(np.int64), np.floor(px[..., 1]).astype(np.int64)
    inside = (ix >= 0) & (ix < res) & (iy >= 0) & (iy < res)
    flat = (np.arange(m)[:, None] * res * res + iy * res + ix)[inside]
    return np.bincount(flat, minlength=m * res * res).reshape(m, res, res).astype(np.float32)


def _sample_systems(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` candidate systems: params [count, 4, 7] and active-map mask [count, 4]."""
    k = rng.integers(2, 5, count)
    active = (np.arange(4)[None] < k[:, None]).astype(np.float64)
    s1 = rng.uniform(0.25, 0.9, (count, 4))
    s2 = s1 * rng.uniform(0.15, 1.0, (count, 4))
    params = np.stack(
        [
            rng.uniform(0, 2 * np.pi, (count, 4)),
            rng.uniform(0, 2 * np.pi, (count, 4)),
            s1,
            s2,
            rng.choice([-1.0, 1.0], (count, 4)),
            rng.uniform(-1, 1, (count, 4)),
            rng.uniform(-1, 1, (count, 4)),
        ],
        axis=-1,
    )
    return params, active


def _fine_systems() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    params, active, hue = class_systems("target")
    rng = np.random.default_rng(_FINE_SEED)
    delta = np.zeros((2, 4, 7))
    delta[..., 0:2] = rng.normal(0, 0.08, (2, 4, 2))
    delta[..., 2:4] = rng.normal(0, 0.03, (2, 4, 2))
    delta[..., 5:7] = rng.normal(0, 0.05, (2, 4, 2))
    delta *= _FINE_DELTA
    base = params[6:8]
    split = np.stack([base[0] + delta[0], base[0] - delta[0], base[1] + delta[1], base[1] - delta[1]])
    split[..., 2:4] = np.clip(split[..., 2:4], 0.05, 0.95)
    return (
        np.concatenate([params[:6], split]),
        np.concatenate([active[:6], np.repeat(active[6:8], 2, axis=0)]),
        np.concatenate([hue[:6], np.repeat(hue[6:8], 2)]),  # a split system's two classes share its hue
    )


@lru_cache(maxsize=3)
def class_systems(task: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The task's classes: params [C, 4, 7], active-map mask [C, 4], hue [C] (NaN = shape-only).
    Candidates are drawn in batches and kept when their attractor covers 5-60 % of a 32 px canvas."""
    _check_task(task)
    if task == "fine":
        return _fine_systems()
    if task in _SPLIT_TASKS:
        params, active, hue = class_systems("target")
        return (
            np.concatenate([params[:6], np.repeat(params[6:8], 2, axis=0)]),
            np.concatenate([active[:6], np.repeat(active[6:8], 2, axis=0)]),
            np.concatenate([hue[:6], np.repeat(hue[6:8], 2)]),
        )
    if task in _SATURATION:
        params, active, hue = class_systems("target")
        return np.repeat(params[:5], 2, axis=0), np.repeat(active[:5], 2, axis=0), np.repeat(hue[:5], 2)
    rng = np.random.default_rng(_SYSTEM_SEEDS[task])
    want = num_classes(task)
    kept_p, kept_a = [], []
    while sum(len(p) for p in kept_p) < want:
        params, active = _sample_systems(rng, 256)
        pts = _normalise(_chaos_game(_maps(params), _map_probabilities(params, active), 3000, rng))
        counts = _histogram((pts * 0.9 + 0.5) * _SIZE, _SIZE)
        coverage = (counts > 0).mean((1, 2))
        ok = (coverage >= _COVERAGE[0]) & (coverage <= _COVERAGE[1])
        kept_p.append(params[ok])
        kept_a.append(active[ok])
    params, active = np.concatenate(kept_p)[:want], np.concatenate(kept_a)[:want]
    hue = rng.uniform(0, 1, want)
    hue[rng.random(want) < _SHAPE_ONLY_SHARE] = np.nan
    return params, active, hue


def class_names(task: str) -> tuple[str, ...]:
    """E.g. "ifs017-3maps-h0.62" or "ifs101-2maps-anyhue": the system index, map count and hue."""
    params, active, hue = class_systems(task)
    prefix = {
        "source": "ifs",
        "target": "ifs-t",
        "fine": "ifs-f",
        "pale": "ifs-p",
        "muted": "ifs-m",
        "mix": "ifs-x",
        "size": "ifs-s",
        "place": "ifs-l",
    }[task]
    suffix = {
        "fine": ("",) * 6 + ("+d", "-d", "+d", "-d"),
        "pale": ("/vivid", "/pale") * 5,
        "muted": ("/vivid", "/muted") * 5,
        "mix": ("",) * 6 + ("/vivid", "/muted") * 2,
        "size": ("",) * 6 + ("/large", "/small") * 2,
        "place": ("",) * 6 + ("/top", "/bottom") * 2,
    }.get(task, ("",) * len(hue))
    return tuple(
        f"{prefix}{i:03d}-{int(a.sum())}maps-" + ("anyhue" if np.isnan(h) else f"h{h:.2f}") + x
        for i, (a, h, x) in enumerate(zip(active, hue, suffix))
    )


# -------------------------------------------------------------------------------------- rendering
def _hsv_to_rgb(h: np.ndarray, s: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Vectorised HSV -> RGB, all in [0, 1]; returns [..., 3]."""
    i = np.floor(h * 6) % 6
    f = h * 6 - np.floor(h * 6)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    table = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)]
    out = np.zeros((*h.shape, 3), np.float32)
    for k, (r, g, b) in enumerate(table):
        sel = i == k
        out[sel] = np.stack([r[sel], g[sel], b[sel]], -1)
    return out


def _instances(
    rng: np.random.Generator, params: np.ndarray, active: np.ndarray, points: int, scale, res: int, place=None
):
    """Per-instance perturbed systems rendered at ``res``: [m, res, res] point counts. ``place`` [m]:
    -1 / +1 pushes an object to the top / bottom of the canvas as far as it fits, 0 leaves it anywhere
    (the same random numbers either way, so tasks without it render the same bytes)."""
    m = params.shape[0]
    p = params.copy()
    p[..., 0:2] += rng.normal(0, 0.08, (m, 4, 2))
    p[..., 2:4] = np.clip(p[..., 2:4] + rng.normal(0, 0.03, (m, 4, 2)), 0.05, 0.95)
    p[..., 5:7] += rng.normal(0, 0.05, (m, 4, 2))
    pts = _normalise(_chaos_game(_maps(p), _map_probabilities(p, active), points, rng))
    angle = rng.uniform(0, 2 * np.pi, m)
    flip = rng.choice([-1.0, 1.0], m)
    ca, sa = np.cos(angle)[:, None], np.sin(angle)[:, None]
    x, y = pts[..., 0] * flip[:, None], pts[..., 1]
    rx, ry = ca * x - sa * y, sa * x + ca * y
    # a rotated unit box spans up to sqrt(2): keep the object inside the canvas
    span = scale / np.sqrt(2)
    room = (0.5 - span[:, None] / 2).clip(0, None)
    off = rng.uniform(-1, 1, (m, 2)) * room * 0.8  # this order of products: the bytes of before the place cue
    if place is not None:
        off[:, 1] = np.where(place != 0, place * room[:, 0] * 0.8, off[:, 1])
    px = np.stack([rx * scale[:, None] + 0.5 + off[:, :1], ry * scale[:, None] + 0.5 + off[:, 1:]], -1) * res
    return _histogram(px, res)


def _downsample(counts: np.ndarray) -> np.ndarray:
    m, r, _ = counts.shape
    return counts.reshape(m, _SIZE, r // _SIZE, _SIZE, r // _SIZE).sum((2, 4))


def _colour(rng: np.random.Generator, hue_mean: np.ndarray, saturation=None) -> np.ndarray:
    """[m, 3] object colours: the class hue (+-0.08) or any hue where the class has none (NaN);
    saturation 0.5-1.0, or mapped into per-image (low, high) ranges ``saturation`` [m, 2] (the same
    random numbers either way, so tasks without it render the same bytes)."""
    m = hue_mean.shape[0]
    hue = np.where(np.isnan(hue_mean), rng.uniform(0, 1, m), hue_mean + rng.normal(0, _HUE_JITTER, m)) % 1.0
    sat = rng.uniform(0.5, 1.0, m)
    if saturation is not None:
        sat = saturation[:, 0] + (sat - 0.5) / 0.5 * (saturation[:, 1] - saturation[:, 0])
    return _hsv_to_rgb(hue, sat, rng.uniform(0.6, 1.0, m))


def _dead_leaves(rng: np.random.Generator, m: int) -> np.ndarray:
    """[m, 3, 32, 32] dead-leaves backgrounds (later leaves occlude earlier ones), low-pass filtered."""
    yy, xx = np.mgrid[0:_SIZE, 0:_SIZE].astype(np.float32) + 0.5
    canvas = np.broadcast_to(rng.uniform(0.1, 0.9, (m, 3, 1, 1)).astype(np.float32), (m, 3, _SIZE, _SIZE)).copy()
    rmin, rmax = 1.5, 14.0
    u = rng.random((_LEAVES, m))
    radius = (rmin**-2 - u * (rmin**-2 - rmax**-2)) ** -0.5  # density ~ r^-3 on [rmin, rmax]
    centre = rng.uniform(-2, _SIZE + 2, (_LEAVES, m, 2))
    square = rng.random((_LEAVES, m)) < 0.5
    angle = rng.uniform(0, np.pi / 2, (_LEAVES, m))
    # leaves are greyish-coloured: a random colour pulled toward its own grey level, so the
    # object (saturated) stands out while the background keeps natural-image-like edges
    col = rng.uniform(0, 1, (_LEAVES, m, 3))
    col = (0.5 * col + 0.5 * col.mean(-1, keepdims=True)).astype(np.float32)
    for leaf in range(_LEAVES):
        dx = xx[None] - centre[leaf, :, 0, None, None]
        dy = yy[None] - centre[leaf, :, 1, None, None]
        c, s = np.cos(angle[leaf])[:, None, None], np.sin(angle[leaf])[:, None, None]
        r = radius[leaf][:, None, None]
        inside_sq = np.maximum(np.abs(c * dx + s * dy), np.abs(-s * dx + c * dy)) <= r * 0.8
        inside_disc = dx * dx + dy * dy <= r * r
        inside = np.where(square[leaf][:, None, None], inside_sq, inside_disc)
        canvas = np.where(inside[:, None], col[leaf, :, :, None, None], canvas)
    # separable [1, 2, 1] / 4 blur, edges replicated
    padded = np.pad(canvas, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="edge")
    canvas = (padded[:, :, :-2] + 2 * padded[:, :, 1:-1] + padded[:, :, 2:]) / 4
    canvas = (canvas[..., :-2] + 2 * canvas[..., 1:-1] + canvas[..., 2:]) / 4
    return canvas.astype(np.float32)


def _composite(canvas: np.ndarray, counts: np.ndarray, colour: np.ndarray, opacity: np.ndarray) -> None:
    """Paint objects (point counts [m, 32, 32]) in ``colour`` [m, 3], shaded by density, onto canvas."""
    alpha = (1.0 - np.exp(-counts / 2.0)) * opacity[:, None, None]
    peak = np.log1p(counts.max((1, 2), keepdims=True)).clip(1e-6, None)
    shade = 0.55 + 0.45 * np.log1p(counts) / peak
    paint = colour[:, :, None, None] * shade[:, None]
    canvas *= 1.0 - alpha[:, None]
    canvas += paint * alpha[:, None]


def render_fdsl_split(task: str, n: int, seed: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``n`` balanced images of ``task``: (uint8 [n, 3, 32, 32], int64 [n]). ``split`` ("train" or
    "test") selects an independent random stream, so test images never repeat training images."""
    _check_task(task)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    params, active, hue = class_systems(task)
    n_classes = len(hue)
    base = [seed, TASKS.index(task), ("train", "test").index(split)]
    labels = np.random.default_rng(base).permutation(np.arange(n) % n_classes).astype(np.int64)
    images = np.empty((n, 3, _SIZE, _SIZE), np.uint8)
    for begin in range(0, n, _CHUNK):
        rng = np.random.default_rng([*base, begin])  # per chunk: the output does not depend on n beyond it
        y = labels[begin : begin + _CHUNK]
        m = y.size
        canvas = _dead_leaves(rng, m)
        for _ in range(2):  # 0-2 faint distractors of OTHER classes
            other = (y + rng.integers(1, n_classes, m)) % n_classes
            present = rng.random(m) < 0.5
            counts = _downsample(
                _instances(rng, params[other], active[other], _DISTRACTOR_POINTS, rng.uniform(0.3, 0.55, m), _RENDER)
            )
            _composite(canvas, counts, _colour(rng, hue[other]), rng.uniform(0.2, 0.5, m) * present)
        scale = rng.uniform(0.55, 0.95, m)
        place = None
        if task == "size":
            bounds = np.array(_SIZE_SCALE)[y]
            scale = bounds[:, 0] + (scale - 0.55) / 0.4 * (bounds[:, 1] - bounds[:, 0])
        if task == "place":
            place = np.array(_PLACE)[y]
            low, high = _PLACE_SCALE
            scale = np.where(place != 0, low + (scale - 0.55) / 0.4 * (high - low), scale)
        counts = _downsample(_instances(rng, params[y], active[y], _POINTS, scale, _RENDER, place))
        sat = np.array(_SATURATION[task])[y % 2] if task in _SATURATION else None
        if task == "mix":
            sat = np.array(_MIX_SATURATION)[y]
        _composite(canvas, counts, _colour(rng, hue[y], sat), rng.uniform(0.85, 1.0, m))
        canvas += _NOISE_STD * rng.standard_normal(canvas.shape, dtype=np.float32)
        images[begin : begin + m] = np.clip(np.rint(canvas * 255.0), 0, 255).astype(np.uint8)
    return images, labels
