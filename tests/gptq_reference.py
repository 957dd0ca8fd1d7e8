"""A frozen copy of GPTQ's column sweep as it was before issue 24's lean sweep (main d06d22b):
one op per step, the objective summed per column. The oracle of tests/test_gptq_solver_exact.py
and benchmarks/bench_gptq_sweep.py (which runs it on CUDA); not used by the project."""
from __future__ import annotations

import math

import torch

from amct_ext.algorithms.gptq import _cholesky_inverse_upper, _group_qparams, _quant_column


@torch.no_grad()
def reference_solve(W, H, spec, *, S=None, Z=None, clip=None, block_size=128, percdamp=0.01,
                     act_order=False):
    """gptq_solve as of main d06d22b (one op per step, the objective summed per column)."""
    B, R, C = W.shape
    W, H = W.clone(), H.clone()
    dynamic = S is None
    gs = spec.group_size if dynamic else None
    if dynamic:
        S = torch.empty_like(W)
        Z = None if spec.symmetric else torch.empty_like(W)
        block_size = math.ceil(block_size / gs) * gs
    diag = H.diagonal(dim1=-2, dim2=-1)
    diag.masked_fill_(diag == 0, 1.0)
    perm = None
    if act_order:
        perm = torch.argsort(diag, dim=-1, descending=True, stable=True)
        W = W.gather(2, perm[:, None, :].expand(B, R, C))
        S = S.gather(2, perm[:, None, :].expand(B, R, C))
        if Z is not None:
            Z = Z.gather(2, perm[:, None, :].expand(B, R, C))
        H = H.gather(1, perm[:, :, None].expand(B, C, C)).gather(2, perm[:, None, :].expand(B, C, C))
    U = _cholesky_inverse_upper(H, percdamp)
    Q = torch.empty_like(W)
    loss = torch.zeros(B, dtype=torch.float64, device=W.device)
    for i1 in range(0, C, block_size):
        i2 = min(i1 + block_size, C)
        W1 = W[:, :, i1:i2].clone()
        Err1 = torch.empty_like(W1)
        U1 = U[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            if dynamic and c % gs == 0:
                g = c // gs
                s, z = _group_qparams(W1[:, :, i:i + gs], spec, None if clip is None else clip[:, :, g:g + 1])
                S[:, :, c:c + gs] = s
                if Z is not None:
                    Z[:, :, c:c + gs] = z
            w = W1[:, :, i]
            d = U1[:, i, i]
            q = _quant_column(w, S[:, :, c], None if Z is None else Z[:, :, c], spec)
            Q[:, :, c] = q
            err = (w - q) / d[:, None]
            loss += err.double().square().sum(-1) / 2
            W1[:, :, i:] -= err[:, :, None] * U1[:, None, i, i:]
            Err1[:, :, i] = err
        if i2 < C:
            W[:, :, i2:] -= torch.bmm(Err1, U[:, i1:i2, i2:])
    if perm is not None:
        idx = torch.argsort(perm, dim=-1)[:, None, :].expand(B, R, C)
        Q, S = Q.gather(2, idx), S.gather(2, idx)
        Z = None if Z is None else Z.gather(2, idx)
    return Q, S, Z, loss
