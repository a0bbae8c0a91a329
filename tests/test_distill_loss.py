"""The fused distillation loss equals the plain computation, in value and in gradients."""

from __future__ import annotations

import pytest
import torch

from surgeon.training.distill_loss import DenseTeacher, LossConfig, TopKTeacher, distill_loss


def plain_loss(hidden, head, t_hidden, t_head, targets, mask, tau, kl_w, ce_w, softcap=None, t_softcap=None):
    def cap(z, c):
        return torch.tanh(z / c) * c if c else z

    z = cap(hidden @ head.T, softcap)
    zt = cap(t_hidden @ t_head.T, t_softcap)
    s = torch.log_softmax(z / tau, -1)
    t = torch.log_softmax(zt / tau, -1)
    kl = (t.exp() * (t - s)).sum(-1)
    ce = torch.nn.functional.cross_entropy(z, targets, reduction="none")
    m = mask.float()
    return kl_w * tau**2 * (kl * m).sum() / m.sum() + ce_w * (ce * m).sum() / m.sum()


def make(n=37, h=16, v=53, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).float().requires_grad_(True)
    head = torch.randn(v, h, generator=g).mul(0.5).requires_grad_(True)
    t_hidden, t_head = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g).mul(0.5)
    targets = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.3
    return hidden, head, t_hidden, t_head, targets, mask


@pytest.mark.parametrize(
    ("tau", "kl_w", "ce_w", "softcap"),
    [
        (1.0, 1.0, 0.0, None),
        (2.0, 1.0, 0.0, None),
        (1.0, 0.5, 0.3, None),
        (1.0, 1.0, 0.2, 3.0),
    ],
)
def test_fused_loss_and_gradients_match_autograd(tau, kl_w, ce_w, softcap):
    hidden, head, t_hidden, t_head, targets, mask = make()
    expected = plain_loss(hidden, head, t_hidden, t_head, targets, mask, tau, kl_w, ce_w, softcap, softcap)
    expected.backward()
    want_h, want_w = hidden.grad.clone(), head.grad.clone()
    hidden.grad = head.grad = None

    config = LossConfig(temperature=tau, kl_weight=kl_w, ce_weight=ce_w, chunk_tokens=8)
    loss, stats = distill_loss(hidden, head, DenseTeacher(t_hidden, t_head, softcap), targets, mask, config, softcap)
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.allclose(hidden.grad, want_h, atol=1e-6, rtol=1e-4)
    assert torch.allclose(head.grad, want_w, atol=1e-6, rtol=1e-4)
    assert stats["kl"] > 0


def test_frozen_head_gets_no_gradient():
    hidden, head, t_hidden, t_head, targets, mask = make()
    head.requires_grad_(False)
    loss, _ = distill_loss(hidden, head, DenseTeacher(t_hidden, t_head), targets, mask, LossConfig())
    loss.backward()
    assert head.grad is None and hidden.grad is not None


def test_topk_teacher_with_the_whole_vocabulary_is_exact():
    hidden, head, t_hidden, t_head, targets, mask = make()
    t_logits = t_hidden @ t_head.T
    k = t_logits.shape[1]  # every token cached: the bucket is empty, KL exact
    values, indices = t_logits.topk(k, dim=-1)
    teacher = TopKTeacher(indices, values, t_logits.logsumexp(-1))
    loss, _ = distill_loss(hidden, head, teacher, targets, mask, LossConfig(chunk_tokens=5))
    loss.backward()
    expected_h = hidden.grad.clone()
    hidden.grad = head.grad = None
    reference = plain_loss(hidden, head, t_hidden, t_head, targets, mask, 1.0, 1.0, 0.0)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert torch.allclose(expected_h, hidden.grad, atol=1e-6, rtol=1e-4)


def test_topk_bucket_kl_and_its_gradient():
    hidden, head, t_hidden, t_head, targets, mask = make()
    t_logits = t_hidden @ t_head.T
    values, indices = t_logits.topk(6, dim=-1)
    lse = t_logits.logsumexp(-1)
    loss, _ = distill_loss(hidden, head, TopKTeacher(indices, values, lse), targets, mask, LossConfig())
    loss.backward()

    # The bucketed KL, written with autograd: top-k tokens plus one bucket for the rest.
    h2 = hidden.detach().clone().requires_grad_(True)
    q = torch.softmax(h2 @ head.detach().T, -1)
    p = (values - lse[:, None]).exp()
    p_rest, q_k = 1 - p.sum(-1), q.gather(-1, indices)
    q_rest = 1 - q_k.sum(-1)
    kl = (p * (p.log() - q_k.log())).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    m = mask.float()
    reference = (kl * m).sum() / m.sum()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert torch.allclose(hidden.grad, h2.grad, atol=1e-6, rtol=1e-4)
    # A lower bound of the full KL (merging tokens into a bucket can only lose information).
    full = plain_loss(hidden.detach(), head.detach(), t_hidden, t_head, targets, mask, 1.0, 1.0, 0.0)
    assert reference.item() <= full.item() + 1e-6
