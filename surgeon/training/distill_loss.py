"""The distillation loss, fused with the LM head and computed a slice of tokens at a time.

Full logits for a batch are [tokens, vocab] (1,024 x 49,152 x 4 bytes = 200 MB for a small
batch), and a plain implementation makes several of them: student logits, both log-softmaxes,
the teacher probabilities, their gradients. Here each slice of tokens forms its student (and
teacher) logits, its loss and the gradient of the loss with respect to the student's hidden states
and head, then discards the logits. The gradients are kept for backward (they are what backward
would compute anyway), so peak memory is one slice of logits regardless of vocabulary.

Objective per target token (mask > 0), averaged over target tokens:
    kl_weight * T^2 * KL(teacher_T || student_T)  +  ce_weight * CE(student, next token)
with _T meaning softmax at temperature T (Hinton et al.: T^2 keeps gradient scale comparable).
The teacher is given either as hidden states + head (exact) or as cached top-k logits with the
log-sum-exp of the whole vocabulary, in which case KL is taken over the k tokens plus one bucket
for the rest of the vocabulary (exact for what is cached; temperature 1 only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DenseTeacher:
    hidden: torch.Tensor  # [N, H] final hidden states (after the final norm)
    head: torch.Tensor  # [V, H]
    softcap: float | None = None


@dataclass
class TopKTeacher:
    indices: torch.Tensor  # [N, k] int64
    logits: torch.Tensor  # [N, k] raw logits of those tokens
    logsumexp: torch.Tensor  # [N] over the whole vocabulary


@dataclass
class LossConfig:
    temperature: float = 1.0
    kl_weight: float = 1.0
    ce_weight: float = 0.0
    chunk_tokens: int = 256
    matmul_dtype: torch.dtype = torch.float32  # bfloat16 where the hardware does it faster


def distill_loss(
    hidden: torch.Tensor,
    head: torch.Tensor,
    teacher: DenseTeacher | TopKTeacher | None,
    targets: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    softcap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss (a scalar with gradients to `hidden` and, if it requires them, `head`) and its parts."""
    stats: dict[str, float] = {}
    loss = _FusedDistill.apply(hidden, head, teacher, targets, mask.float(), config, softcap, stats)
    return loss, stats


class _FusedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, teacher, targets, mask, config: LossConfig, softcap, stats):
        n = hidden.shape[0]
        denominator = mask.sum().clamp_min(1.0)
        md = config.matmul_dtype
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_head = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if head.requires_grad else None
        head_mm = _in_dtype(head, md)
        use_kl = bool(config.kl_weight) and teacher is not None
        teacher_head = _in_dtype(teacher.head, md) if use_kl and isinstance(teacher, DenseTeacher) else None
        work = _workspace(min(config.chunk_tokens, n), head.shape[0], head.shape[1], hidden.device, md)
        kl_total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        ce_total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        for start in range(0, n, config.chunk_tokens):
            rows = slice(start, min(start + config.chunk_tokens, n))
            w = work.view(rows.stop - rows.start)
            torch.mm(hidden[rows].detach().to(md), head_mm.T, out=w.mm)
            logits = _softcap_(w.logits.copy_(w.mm), softcap)
            grad = w.grad
            if use_kl and teacher_head is not None:
                torch.mm(teacher.hidden[rows].detach().to(md), teacher_head.T, out=w.mm)
                t_logits = _softcap_(w.teacher.copy_(w.mm), teacher.softcap)
                kl = _dense_kl(logits, t_logits, config.temperature, grad, w.scratch)
            elif use_kl:
                kl, topk_grad = _topk_kl(
                    logits, teacher.indices[rows], teacher.logits[rows].float(), teacher.logsumexp[rows].float()
                )
                grad.copy_(topk_grad)
            else:
                kl = None
                grad.zero_()
            if kl is not None:
                kl_total += (kl * mask[rows]).sum().double()
                grad.mul_(config.kl_weight)
            if config.ce_weight:
                nll = _add_ce(logits, targets[rows], config.ce_weight, grad, w.scratch)
                ce_total += (nll * mask[rows]).sum().double()
            grad.mul_((mask[rows] / denominator)[:, None])
            if softcap:  # chain rule through cap * tanh(z / cap): slope 1 - (capped / cap)^2
                grad.mul_(torch.mul(logits, logits, out=w.scratch).mul_(-1.0 / (softcap * softcap)).add_(1.0))
            torch.mm(w.mm.copy_(grad), head_mm, out=w.hidden_mm)
            grad_hidden[rows] = w.hidden_mm
            if grad_head is not None:
                torch.addmm(grad_head, grad.T, hidden[rows].detach().float(), out=grad_head)
        kl_mean = (kl_total / denominator.double()).float()
        ce_mean = (ce_total / denominator.double()).float()
        tau = config.temperature
        loss = config.kl_weight * tau * tau * kl_mean + config.ce_weight * ce_mean
        stats.update(kl=kl_mean.item(), ce=ce_mean.item() if config.ce_weight else float("nan"))
        ctx.save_for_backward(grad_hidden, grad_head if grad_head is not None else torch.empty(0))
        ctx.hidden_dtype, ctx.head_dtype, ctx.has_head_grad = hidden.dtype, head.dtype, grad_head is not None
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_head = ctx.saved_tensors
        scale = grad_output.float()
        out_hidden = (grad_hidden * scale).to(ctx.hidden_dtype)
        out_head = (grad_head * scale).to(ctx.head_dtype) if ctx.has_head_grad else None
        return out_hidden, out_head, None, None, None, None, None, None


@dataclass
class _Buffers:
    logits: torch.Tensor
    teacher: torch.Tensor
    grad: torch.Tensor
    scratch: torch.Tensor
    mm: torch.Tensor
    hidden_mm: torch.Tensor


class _Workspace:
    """[tokens, vocab] buffers reused across chunks and calls: allocating a tensor this size costs
    more (fresh pages from the kernel) than the arithmetic done in it."""

    def __init__(self, rows: int, vocab: int, hidden: int, device, md):
        def buffer(*shape, dtype=torch.float32):
            return torch.empty(*shape, dtype=dtype, device=device)

        self.full = _Buffers(
            buffer(rows, vocab),
            buffer(rows, vocab),
            buffer(rows, vocab),
            buffer(rows, vocab),
            buffer(rows, vocab, dtype=md),
            buffer(rows, hidden, dtype=md),
        )

    def view(self, rows: int) -> _Buffers:
        return _Buffers(*(getattr(self.full, f)[:rows] for f in _Buffers.__dataclass_fields__))


_WORKSPACES: dict = {}
_CONVERTED: dict = {}


def _in_dtype(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in the matmul dtype, converted once while it is unchanged (a frozen head, every step)."""
    if weight.dtype == dtype:
        return weight.detach()
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), dtype)
    if key not in _CONVERTED:
        if len(_CONVERTED) >= 2:
            _CONVERTED.clear()
        _CONVERTED[key] = weight.detach().to(dtype)
    return _CONVERTED[key]


def _workspace(rows: int, vocab: int, hidden: int, device, md) -> _Workspace:
    key = (rows, vocab, hidden, str(device), md)
    if key not in _WORKSPACES:
        _WORKSPACES.clear()  # one shape at a time: a new model or chunk size replaces the old buffers
        _WORKSPACES[key] = _Workspace(rows, vocab, hidden, device, md)
    return _WORKSPACES[key]


def _softcap_(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's cap * tanh(logits / cap), in place."""
    if cap:
        logits.div_(cap).tanh_().mul_(cap)
    return logits


def _log_softmax_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._log_softmax.out(x, -1, False, out=out)


def _dense_kl(logits: torch.Tensor, t_logits: torch.Tensor, tau: float, grad: torch.Tensor, scratch: torch.Tensor):
    """Per-token KL(p_T || q_T); writes d(T^2 KL)/d(student logits) = T (q_T - p_T) into `grad`.

    Everything happens in preallocated buffers; `t_logits` is overwritten (it becomes p_T).
    """
    if tau != 1:
        t_logits.div_(tau)
        student = torch.div(logits, tau, out=scratch)
    else:
        student = logits
    log_q = _log_softmax_into(student, grad)  # grad holds log q_T for now; scratch is free again
    log_p = t_logits.copy_(_log_softmax_into(t_logits, scratch))
    diff = torch.sub(log_p, log_q, out=scratch)  # log p - log q
    p = log_p.exp_()
    kl = diff.mul_(p).sum(-1)
    grad.exp_().sub_(p)
    if tau != 1:
        grad.mul_(tau)
    return kl


def _add_ce(logits: torch.Tensor, targets: torch.Tensor, weight: float, grad: torch.Tensor, scratch: torch.Tensor):
    """Adds weight * d CE / d logits = weight (softmax - onehot) to `grad`; returns per-token NLL."""
    log_q = _log_softmax_into(logits, scratch)
    nll = -log_q.gather(-1, targets[:, None]).squeeze(-1)
    probs = log_q.exp_()
    probs.scatter_add_(-1, targets[:, None], -torch.ones_like(nll)[:, None])
    grad.add_(probs, alpha=weight)
    return nll


def _topk_kl(
    student_logits: torch.Tensor, indices: torch.Tensor, teacher_topk: torch.Tensor, teacher_lse: torch.Tensor
):
    """KL over the teacher's top-k tokens plus one bucket for the rest, and its logit gradient.

    With p, q the teacher and student probabilities, P and Q the mass outside the top k:
    KL = sum_k p_k log(p_k / q_k) + P log(P / Q); d/dz_j = q_j - p_j inside the top k and
    q_j (1 - P / Q) outside (the bucket's share spread as the student spreads it).
    """
    q = torch.softmax(student_logits, dim=-1)
    log_p = teacher_topk - teacher_lse[:, None]
    p = log_p.exp()
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_k = q.gather(-1, indices)
    q_rest = (1 - q_k.sum(-1)).clamp_min(1e-12)
    tiny = torch.finfo(torch.float32).tiny
    kl = (p * (log_p - torch.log(q_k.clamp_min(tiny)))).sum(-1)
    kl = kl + torch.where(
        p_rest > 0, p_rest * (torch.log(p_rest.clamp_min(tiny)) - torch.log(q_rest)), torch.zeros_like(p_rest)
    )
    grad = q * (1 - p_rest / q_rest)[:, None]
    grad.scatter_(-1, indices, q_k - p)
    return kl, grad
