"""V4's clamped SwiGLU and the routed-expert combine as Triton kernels (CUDA), and the combine
with its own backward (``SlotCombine``: block-wise rounding's stacked experts; any device).

Between the two expert GEMMs, ``Expert.forward`` / ``MoE.route_grouped`` compute, per row,

    up = clamp(x @ w3, -L, L);  gate = clamp(x @ w1, max=L);  h = silu(gate) * up * route_weight

in fp32 from the bf16 GEMM output, then round h to bf16. In torch that is ~8 passes over fp32
copies of a [T, 2I] tensor (T = 6 x tokens rows: 24576 x 4096 at S = 4096), ~1.5 ms per layer on an
H200; the kernel reads the bf16 [T, 2I] once and writes the bf16 [T, I] once.

Numerics: the same fp32 operations in the same order; silu is x / (1 + exp(-x)) as in torch, with
Triton's exp (last-bit differences in fp32, before the bf16 rounding). Checked against the torch
expression under Triton's interpreter (tests/test_fused_attention.py) and at full shape on the GPU
(benchmarks/check_fast_paths.py).
"""
from __future__ import annotations

import torch

from amct_ext.runtime.device import device_guard, fused_kernels_enabled
from amct_ext.runtime.triton_support import triton, tl  # noqa: F401  (None without Triton)


if triton is not None:

    @triton.jit
    def _swiglu_kernel(h_ptr, w_ptr, out_ptr, I, limit, HAS_W: tl.constexpr, HAS_LIMIT: tl.constexpr,
                       BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        gate = tl.load(h_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            up = tl.minimum(tl.maximum(up, -limit), limit)
            gate = tl.minimum(gate, limit)
        y = gate / (1.0 + tl.exp(-gate)) * up
        if HAS_W:
            y = y * tl.load(w_ptr + row)
        tl.store(out_ptr + row * I + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


if triton is not None:

    @triton.jit
    def _combine_kernel(y_ptr, rows_ptr, out_ptr, D, K: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < D
        r = tl.load(rows_ptr + t * K).to(tl.int64)
        acc = tl.load(y_ptr + r * D + offs, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(1, K):
            r = tl.load(rows_ptr + t * K + j).to(tl.int64)
            acc += tl.load(y_ptr + r * D + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + offs, acc, mask=mask)


def combine_rows(y: torch.Tensor, rows: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """out[t] = sum_j y[rows[t, j]] in fp32, j in order: y [T, D] (the experts' outputs in sorted
    order), rows [N, k] -> [N, D] fp32. The same fp32 additions in the same order as gathering
    and adding in torch (no multiply, so nothing to contract): bit-identical."""
    if triton is None:
        raise RuntimeError("combine_rows needs Triton")
    y = y.contiguous()
    rows = rows.contiguous()
    n, k = rows.shape
    dim = y.shape[1]
    out = torch.empty(n, dim, dtype=torch.float32, device=y.device)
    with device_guard(y.device):
        _combine_kernel[(n, triton.cdiv(dim, block))](y, rows, out, dim, K=k, BLOCK=block, num_warps=4)
    return out


def slot_rows(order: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k]: each token's rows in the expert-sorted slots (``order``: the stable argsort of the
    flattened [N, k] expert indices), in expert order -- the order ``route`` sums them in."""
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return rank.view(-1, k).sort(dim=1).values


class SlotCombine(torch.autograd.Function):
    """``out[t] = sum_j y[rows[t, j]]`` in fp32, j in order (what ``combine_rows`` computes), with
    its own backward: every row of ``y`` belongs to exactly one token, so ``grad_y[r]`` is that
    token's ``grad_out`` in y's dtype -- one gather. The same numbers as autograd through the k
    gathers and adds, which instead fills a zero [T, D] per gather, scatters into it and adds the k
    of them (a V4-Flash step: ~15 ms of a 0.38 s step on an H100, results/block-rounding.md PH).

    ``token_of_row [T]``: the token of each row of ``y`` (``rows``' inverse). The forward runs
    ``combine_rows`` where the Triton kernels run, else the torch gathers in the same order."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, rows: torch.Tensor, token_of_row: torch.Tensor, fused: bool) -> torch.Tensor:
        ctx.save_for_backward(token_of_row)
        ctx.y_dtype = y.dtype
        if fused:
            return combine_rows(y, rows)
        out = y[rows[:, 0]].float()
        for j in range(1, rows.shape[1]):
            out = out + y[rows[:, j]].float()
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (token_of_row,) = ctx.saved_tensors
        # fp32 -> y's dtype once per row: what the cast in ``y[...].float()`` does to each gradient
        return grad_out[token_of_row].to(ctx.y_dtype), None, None, None


def combine_slots(y: torch.Tensor, rows: torch.Tensor, token_of_row: torch.Tensor) -> torch.Tensor:
    """``SlotCombine`` under autograd (y [T, D] sorted slots, rows [N, k] -> [N, D] fp32), the
    Triton combine in the forward where the project's kernels run on y's device."""
    # fused_kernels_enabled: CUDA with Triton importable (so combine_rows is defined)
    return SlotCombine.apply(y, rows, token_of_row, y.dtype != torch.float64 and fused_kernels_enabled(y.device))


def clamped_swiglu(h: torch.Tensor, limit: float, weights: torch.Tensor | None = None,
                   block: int = 1024) -> torch.Tensor:
    """h [T, 2I] = [x @ w1 | x @ w3] (16-bit), weights [T] fp32 or None -> [T, I] in h's dtype."""
    if triton is None:
        raise RuntimeError("clamped_swiglu needs Triton")
    h = h.contiguous()
    rows, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    has_w = weights is not None
    w = weights.float().contiguous() if has_w else h
    grid = (rows, triton.cdiv(inter, block))
    with device_guard(h.device):
        _swiglu_kernel[grid](h, w, out, inter, float(limit), HAS_W=has_w, HAS_LIMIT=limit > 0, BLOCK=block, num_warps=4)
    return out


# ----------------------------------------------------------------------------- grouped expert GEMM
# Rows sorted by expert, ~96 per expert at S = 4096 (6 x 4096 slots over 256 experts). The GEMM is
# bound by reading the 12 GB of routed-expert weights; torch._grouped_mm moves them at ~2.6 TB/s on
# an H200 (RESULTS.md §4.3). Here each program owns one BLOCK_M-row tile of one expert and one
# BLOCK_N slice of the output; the programs of a few consecutive tiles run next to each other, so
# each weight slice is read from HBM once and the activation tile stays in L2.
# Launch shapes from the sweep in benchmarks/check_fast_paths.py --sweep (H200, RESULTS.md §4.3).
GROUPED_GEMM_LAUNCH = {"block_m": 128, "block_n": 256, "block_k": 64, "group_m": 4, "num_warps": 8,
                       "num_stages": 3}
# the fused SwiGLU keeps two accumulators (gate and up): half the columns per program
SWIGLU_GEMM_LAUNCH = {**GROUPED_GEMM_LAUNCH, "block_n": 128, "num_stages": 4}
# above this many rows per expert (on average) torch._grouped_mm's CUTLASS kernel was faster
GROUPED_GEMM_MAX_ROWS_PER_EXPERT = 192

if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, ends_ptr, tile_ends_ptr, rw_ptr, N, E, MAX_TILES, limit,
                             stride_am, stride_we, stride_wn, stride_cm, K: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                             SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, PRECISION: tl.constexpr):
        pid = tl.program_id(0)
        n_tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * n_tiles_n
        first = (pid // per_group) * GROUP_M
        size = tl.minimum(MAX_TILES - first, GROUP_M)
        tile = first + (pid % per_group) % size
        pid_n = (pid % per_group) // size
        # which expert owns this row tile: tile_ends[e] = tiles of experts 0..e (inclusive)
        es = tl.arange(0, BLOCK_E)
        tile_ends = tl.load(tile_ends_ptr + es, mask=es < E, other=2147483647)
        e = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)
        if e >= E:
            return  # past the last tile: the grid is sized for the worst case without a host sync
        tiles_before = tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0)
        row_begin = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        row_end = tl.load(ends_ptr + e)
        rows = row_begin + (tile - tiles_before) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
        w_ptrs = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SWIGLU:  # w = [w1; w3]: the up projection's rows start N rows further
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
                if SWIGLU:
                    w_up = tl.load(w_ptrs + N * stride_wn, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k + ks) < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                if SWIGLU:
                    w_up = tl.load(w_ptrs + N * stride_wn, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if SWIGLU:
                acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SWIGLU:
            # as Expert.forward: the projections in the GEMM's dtype, then fp32 clamp / silu / product
            gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
            up = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
            if HAS_LIMIT:
                up = tl.minimum(tl.maximum(up, -limit), limit)
                gate = tl.minimum(gate, limit)
            acc = gate / (1.0 + tl.exp(-gate)) * up
            acc = acc * tl.load(rw_ptr + rows, mask=row_ok, other=0.0)[:, None]
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm_suited(rows: int, n_experts: int) -> bool:
    """Whether ``grouped_gemm`` is the faster kernel for this many rows (see the constants above)."""
    return rows <= GROUPED_GEMM_MAX_ROWS_PER_EXPERT * n_experts


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, launch: dict | None = None,
                 swiglu_limit: float | None = None, row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[r] = a[r] @ w[e].T for the rows r of expert e: a [T, K] sorted by expert, w [E, N, K],
    ends [E] int (cumulative row counts, ``torch._grouped_mm``'s ``offs``) -> [T, N] in a's dtype.

    With ``swiglu_limit`` (w = [w1; w3], [E, 2I, K]) the epilogue is the clamped SwiGLU of
    ``clamped_swiglu`` times ``row_weights`` [T] -> [T, I]: the [T, 2I] projections are never
    written. fp32 accumulation over K in BLOCK_K steps (torch._grouped_mm also accumulates in
    fp32; the order of the additions differs). No host sync: the grid covers the most tiles T rows
    can make, and programs past the last tile return at once."""
    if triton is None:
        raise RuntimeError("grouped_gemm needs Triton")
    swiglu = swiglu_limit is not None
    cfg = {**(SWIGLU_GEMM_LAUNCH if swiglu else GROUPED_GEMM_LAUNCH), **(launch or {})}
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[2] or ends.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm: a {tuple(a.shape)}, w {tuple(w.shape)}, ends {tuple(ends.shape)} do not fit "
                         "a [T, K], w [E, N, K], ends [E]")
    if swiglu and (w.shape[1] % 2 or row_weights is None or row_weights.shape != (a.shape[0],)):
        raise ValueError(f"grouped_gemm with SwiGLU: w {tuple(w.shape)} must stack [w1; w3] and row_weights "
                         f"must be [{a.shape[0]}]")
    a = a.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    rows, k = a.shape
    n_exp, n = w.shape[0], w.shape[1] // (2 if swiglu else 1)
    bm = cfg["block_m"]
    ends = ends.to(torch.int32)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tile_ends = torch.cumsum(torch.div(counts + bm - 1, bm, rounding_mode="floor"), 0).to(torch.int32)
    max_tiles = triton.cdiv(rows, bm) + n_exp
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    rw = row_weights.float().contiguous() if swiglu else out
    grid = (max_tiles * triton.cdiv(n, cfg["block_n"]),)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    with device_guard(a.device):
        _grouped_gemm_kernel[grid](
            a, w, out, ends, tile_ends, rw, n, n_exp, max_tiles, float(swiglu_limit or 0.0),
            a.stride(0), w.stride(0), w.stride(1), out.stride(0), K=k,
            BLOCK_M=bm, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], BLOCK_E=triton.next_power_of_2(n_exp),
            GROUP_M=cfg["group_m"], EVEN_K=k % cfg["block_k"] == 0, SWIGLU=swiglu,
            HAS_LIMIT=bool(swiglu_limit), PRECISION=precision, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
    return out
