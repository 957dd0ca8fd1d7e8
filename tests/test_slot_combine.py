"""SlotCombine (fused_moe): the routed experts' combine with its own backward, against autograd
through the gathers and adds it replaces -- the same forward and the same gradient, bit for bit."""
import pytest
import torch

from models.deepseek_v4.fused_moe import SlotCombine, combine_slots


def _routing(n_tokens: int, k: int, n_experts: int, seed: int):
    """(rows [N, k], token_of_row [N k]) as QuantV4MoE.route_stacked builds them: slots sorted by
    expert, each token's rows in expert order."""
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n_tokens)])
    order = indices.flatten().argsort(stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    rows = rank.view(-1, k).sort(dim=1).values
    return rows, order // k


def _autograd_reference(y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = y[rows[:, 0]].float()
    for j in range(1, rows.shape[1]):
        out = out + y[rows[:, j]].float()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradient_equal_autograd_through_the_gathers(dtype):
    rows, token_of_row = _routing(n_tokens=37, k=6, n_experts=16, seed=0)
    g = torch.Generator().manual_seed(1)
    y0 = torch.randn(rows.numel(), 24, generator=g).to(dtype)
    upstream = torch.randn(rows.shape[0], 24, generator=g)

    y_ref = y0.clone().requires_grad_(True)
    ref = _autograd_reference(y_ref, rows)
    (ref * upstream).sum().backward()

    y_new = y0.clone().requires_grad_(True)
    out = combine_slots(y_new, rows, token_of_row)
    (out * upstream).sum().backward()

    assert out.dtype == torch.float32
    assert torch.equal(out, ref)
    assert y_new.grad.dtype == dtype
    assert torch.equal(y_new.grad, y_ref.grad)


def test_a_row_given_another_tokens_gradient_is_caught():
    """The check above can fail: one row mapped to the wrong token changes the gradient."""
    rows, token_of_row = _routing(n_tokens=9, k=3, n_experts=8, seed=2)
    y = torch.randn(rows.numel(), 5, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(rows.shape[0], 5, dtype=torch.float64)
    (_autograd_reference(y, rows) * upstream).sum().backward()
    want = y.grad.clone()
    wrong = token_of_row.clone()
    wrong[0] = (wrong[0] + 1) % rows.shape[0]
    y.grad = None
    (SlotCombine.apply(y, rows, wrong, False) * upstream).sum().backward()
    assert not torch.equal(y.grad.float(), want.float())
    assert torch.equal(y.grad[1:].float(), want[1:].float())
