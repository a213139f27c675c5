"""Bit allocation over the rotated channels of a head — the half of transform coding a rotation needs.

An orthogonal rotation alone does not lower the error of a quantizer that spends the same bits on every
channel of the rotated vector (it does not equalize anything: it concentrates). What a decorrelating
rotation buys is channels that deserve *different* widths: a few carry most of the energy that reaches the
output, many carry little. Each channel c of a head is given its own index width ``b_c`` from the cost

    D_c(b) = w_c · mse_c(b)

with ``mse_c(b)`` the error of a ``b``-bit Lloyd-Max LUT (plus its sign residual, if any) fitted to the
channel's calibration histogram, and ``w_c`` how much an error in that channel reaches the output (keys:
``E[(Π q)_c²] · scale_c²``, the score error it causes; values: ``scale_c² · (Π W_oᵀ W_o Πᵀ)_cc``). Widths
are chosen greedily by marginal gain (optimal for costs convex in b) under the packed layout's rule
(:func:`esm_turbo.quant.packing.field_layout`): each group of 8 consecutive channels spends exactly 8 × the
average width, and slot r of every group has the same width (period 8: the decode kernel keeps 8 shifts
per head in registers, not d). Channels are dealt into the groups round-robin in order of
``w_c · mse_c(bits)``, so slot r holds the r-th tier of importance; this order becomes the rows of Π (free
at run time: attention is computed in the rotated domain).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lloyd_max import SortedPoints, lloyd_max_sorted
from .residual import sign_eps_sorted

GROUP = 8  # channels per packed group word


def widest_bits(bits: int, max_bits: int | None) -> int:
    """The widest channel an allocation of ``bits`` on average may give: ``max_bits`` (default bits + 1, ≤ 8)."""
    top = min(max_bits if max_bits is not None else bits + 1, 8)
    if not bits <= top:
        raise ValueError(f"max_bits {max_bits} is below the average width {bits}")
    return top


@dataclass
class ChannelTables:
    """LUTs of every width 0 … B for G groups: luts[b] [G, 2^b] and sign magnitudes eps[b] [G, 2^b, 2] (None
    without a sign residual), fp16 values in float64 (``grid``: uniform levels, see :func:`grid_tables`, in
    float64); mse [G, B + 1] of each width."""

    luts: list[torch.Tensor]
    eps: list[torch.Tensor | None]
    mse: torch.Tensor
    grid: bool = False

    def rows(self, start: int, stop: int) -> "ChannelTables":
        """The tables of groups [start, stop)."""
        return ChannelTables([t[start:stop] for t in self.luts],
                             [t[start:stop] if t is not None else None for t in self.eps], self.mse[start:stop],
                             self.grid)


def channel_tables(values: torch.Tensor, weights: torch.Tensor, max_bits: int,
                   sign_mode: str | None) -> ChannelTables:
    """:class:`ChannelTables` of widths 0 … ``max_bits`` for G groups of points values, weights [G, N] (one
    sort; cells summed from prefix sums). Width 0 is one level, the weighted mean."""
    points = SortedPoints(values, weights)
    luts, eps, mse = [], [], []
    for b in range(max_bits + 1):
        lut = points.mean()[:, None] if b == 0 else lloyd_max_sorted(points, b)[0]
        lut = lut.half().double()
        e = sign_eps_sorted(points, lut, sign_mode).half().double() if sign_mode else None
        luts.append(lut)
        eps.append(e)
        mse.append(_mse(points, lut, e))
    return ChannelTables(luts, eps, torch.stack(mse, 1))


def grid_tables(values: torch.Tensor, weights: torch.Tensor, max_bits: int, sign: bool,
                iterations: int = 300, span: float = 0.0) -> ChannelTables:
    """:class:`ChannelTables` of *uniform* quantizers, widths 0 … ``max_bits``: a channel of b index bits (+ the
    sign bit, ``sign``) has n = 2^(b + sign) evenly spaced levels ``a + s·j``, its code j the level's rank, so a
    decoder computes a value from its code instead of looking it up (the GPU kernels' ``GRID`` path). With a sign
    bit the index picks a pair of levels and the sign one of the two: centroid ``a + s·(2i + ½)``, ε = s/2 on
    both sides — nearest-level coding of the n levels. Each (a, s) minimises the weighted squared error by
    alternating nearest-level cells and the least-squares line through them (each step lowers it), starting
    from the span of an n-level Lloyd-Max fit, until no step moves by 1e-12 of its size (or ``iterations``).
    Width 0 without a sign is one level, the mean. ``span`` > 0 then moves the outer levels that share of the way
    out to the points' extremes (:func:`_spanned`); the widths' errors are those of the levels kept."""
    points = SortedPoints(values, weights)
    luts, eps, mse = [], [], []
    for b in range(max_bits + 1):
        n = 1 << (b + int(sign))
        if n == 1:
            levels = points.mean()[:, None]
        else:
            levels = _spanned(points, _uniform_fit(points, lloyd_max_sorted(points, b + int(sign))[0], iterations),
                              span)
        if sign:
            lut = 0.5 * (levels[:, 0::2] + levels[:, 1::2])
            e = (0.5 * (levels[:, 1::2] - levels[:, 0::2]))[..., None].expand(-1, -1, 2).contiguous()
        else:
            lut, e = levels, None
        luts.append(lut)
        eps.append(e)
        mse.append(_mse(points, levels, None))
    return ChannelTables(luts, eps, torch.stack(mse, 1), grid=True)


#: the fewest levels a grid's range is widened at (:func:`_spanned`): coarser grids keep their least-squares range
SPAN_MIN_LEVELS = 8


def _spanned(points: SortedPoints, levels: torch.Tensor, span: float) -> torch.Tensor:
    """Evenly spaced levels [G, n] whose outer ones moved ``span`` (0 … 1) of the way out to the points' extremes
    (never inwards), for grids of at least :data:`SPAN_MIN_LEVELS` levels: the least-squares fit clips a channel's
    rare large values to its outer levels, and on trained models those clipped tokens are the worst decoded ones;
    a grid of 2 or 4 levels pays more in its typical values than it saves (``docs/recipe.md``, "Grid ranges")."""
    if span <= 0 or levels.shape[1] < SPAN_MIN_LEVELS:
        return levels
    n = levels.shape[1]
    lo = levels[:, :1] + span * (points.lo[:, None] - levels[:, :1]).clamp(max=0)
    hi = levels[:, -1:] + span * (points.hi[:, None] - levels[:, -1:]).clamp(min=0)
    return lo + (hi - lo) / (n - 1) * torch.arange(n, dtype=levels.dtype, device=levels.device)


def _uniform_fit(points: SortedPoints, start: torch.Tensor, iterations: int) -> torch.Tensor:
    """Evenly spaced levels [G, n] ``a + s·j`` fitted to sorted points from a first guess [G, n] (its span)."""
    n = start.shape[1]
    j = torch.arange(n, dtype=torch.float64, device=start.device)
    a, s = start[:, :1], ((start[:, -1:] - start[:, :1]) / (n - 1))
    floor = 1e-9 * (points.hi - points.lo).clamp_min(1e-12)[:, None]
    for _ in range(iterations):
        s = torch.maximum(s, floor)
        edges = points.cell_edges(a + s * j)
        w, wx, _ = points.sums(edges[:, :-1], edges[:, 1:])  # [G, n] each
        sw, sj, sjj = w.sum(1, keepdim=True), (w * j).sum(1, keepdim=True), (w * j * j).sum(1, keepdim=True)
        sx, sjx = wx.sum(1, keepdim=True), (wx * j).sum(1, keepdim=True)
        det = sw * sjj - sj * sj
        ok = det > 1e-12 * sw * sjj.clamp_min(1e-300)  # two or more cells hold points
        new_a = torch.where(ok, (sjj * sx - sj * sjx) / det.where(ok, 1.0), a)
        new_s = torch.where(ok, (sw * sjx - sj * sx) / det.where(ok, 1.0), s)
        moved = torch.maximum((new_a - a).abs(), (new_s - s).abs() * n) / s
        a, s = new_a, new_s
        if bool((moved < 1e-12).all()):
            break
    return a + torch.maximum(s, floor) * j


def _mse(points: SortedPoints, lut: torch.Tensor, eps: torch.Tensor | None) -> torch.Tensor:
    """Weighted mean squared error [G] of reconstructing the points with a LUT [G, K] (+ sign magnitudes
    [G, K, 2]: a value is c ± its half cell's magnitude)."""
    mass, abs_r, sq = points.half_cells(lut)
    if eps is not None:  # Σ w (|r| − m)² per half cell
        sq = sq - 2 * eps * abs_r + eps**2 * mass
    return sq.sum((1, 2)) / points.total.clamp_min(1e-300)


def tier_order(importance: torch.Tensor) -> torch.Tensor:
    """Channel order [H, d] dealing channels, most important first, round-robin into the d/8 groups: rank i
    goes to group i mod (d/8), slot i div (d/8). Slot r of every group then holds the r-th tier of
    importance, and one width per slot serves all groups (a layout of period 8, which the kernels keep in
    few registers)."""
    heads, dim = importance.shape
    groups = dim // GROUP
    rank = torch.argsort(importance, dim=1, descending=True, stable=True)  # [H, d] channel of each rank
    r = torch.arange(dim)
    position = (r % groups) * GROUP + r // groups
    order = torch.empty_like(rank)
    order.scatter_(1, position.expand(heads, dim).to(rank.device), rank)
    return order


def allocate(cost: torch.Tensor, bits: int, shared: bool = False) -> torch.Tensor:
    """Widths [H, d] (long) minimising Σ cost[h, c, b_c] with every group of 8 channels spending 8·``bits``
    and slot r of every group the same width (period 8, see :func:`tier_order`): cost [H, d, B + 1] (cost of
    each width 0 … B, non-increasing). Greedy by marginal gain on each slot's cost summed over the groups
    (and, ``shared``, over the heads: every head gets the same widths, which the kernels compile in)."""
    heads, dim, levels = cost.shape
    c = cost.reshape(heads, dim // GROUP, GROUP, levels).sum(1, keepdim=True)
    if shared:
        c = c.sum(0, keepdim=True)
    width = torch.zeros(c.shape[:3], dtype=torch.long, device=cost.device)
    for _ in range(GROUP * bits):
        now = c.gather(3, width[..., None])[..., 0]
        nxt = c.gather(3, (width + 1).clamp(max=levels - 1)[..., None])[..., 0]
        gain = torch.where(width < levels - 1, now - nxt, -torch.inf)
        width.scatter_add_(2, gain.argmax(2, keepdim=True), torch.ones_like(width[..., :1]))
    return width.expand(heads, dim // GROUP, GROUP).reshape(heads, dim).contiguous()
