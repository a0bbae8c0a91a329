"""Evaluation against the parent: KL, top-1 agreement, perplexities, and the parent-logits cache."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import FAMILIES
from surgeon.checkpoints.sources import resolve_source
from surgeon.measure.metrics import compare_to_parent, log_probabilities, parent_reference
from surgeon.text import TextData, token_windows


@pytest.fixture
def setup(tiny_models, text_dir):
    parent = resolve_source(str(tiny_models["llama"]), Path.cwd())
    windows = token_windows(
        parent.load_tokenizer(), [text_dir / "heldout.txt"], TextData(text="x", tokens=768, window=128)
    )
    return parent, windows


def test_a_model_against_itself_scores_zero_kl_and_full_agreement(setup):
    parent, windows = setup
    model = parent.load_model()
    reference = parent_reference(lambda: model, windows, parent.fingerprint())
    metrics = compare_to_parent(model, windows, reference)
    assert metrics["kl_mean"] < 1e-5 and metrics["kl_p99"] < 1e-4
    assert metrics["top1_agreement"] == 1.0
    assert metrics["ppl"] == pytest.approx(metrics["ppl_parent"], rel=1e-6)
    assert metrics["tokens"] == windows.shape[0] * (windows.shape[1] - 1)


def test_metrics_match_a_direct_computation(setup, tiny_models):
    parent, windows = setup
    parent_model = parent.load_model()
    child_model = resolve_source(str(tiny_models["qwen2"]), Path.cwd()).load_model()  # same vocabulary
    metrics = compare_to_parent(
        child_model, windows, parent_reference(lambda: parent_model, windows, parent.fingerprint())
    )

    with torch.no_grad():
        p = torch.log_softmax(parent_model(input_ids=windows).logits[:, :-1].double(), -1)
        q = torch.log_softmax(child_model(input_ids=windows).logits[:, :-1].double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).flatten()
    targets = windows[:, 1:].unsqueeze(-1)
    assert metrics["kl_mean"] == pytest.approx(kl.mean().item(), rel=2e-3)
    assert metrics["kl_median"] == pytest.approx(kl.median().item(), rel=5e-3)
    assert metrics["top1_agreement"] == pytest.approx((p.argmax(-1) == q.argmax(-1)).double().mean().item())
    assert metrics["ppl"] == pytest.approx(math.exp(-q.gather(-1, targets).mean().item()), rel=1e-5)
    assert metrics["ppl_parent"] == pytest.approx(math.exp(-p.gather(-1, targets).mean().item()), rel=1e-5)
    assert metrics["kl_mean"] > 0.1  # two unrelated random models are far apart


def test_parent_logits_are_cached_and_keyed_by_data(setup):
    parent, windows = setup
    model = parent.load_model()
    calls = []

    def load():
        calls.append(1)
        return model

    key = parent.fingerprint() + "-cache-test"  # not shared with the other tests' entries
    first = parent_reference(load, windows, key)
    second = parent_reference(load, windows, key)
    assert first.folder == second.folder and len(calls) == 1  # the second evaluation loads no parent
    other = parent_reference(load, windows[:2], key)
    assert other.folder != first.folder and len(calls) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_logits_equal_the_models_own(family, tiny_models):
    from surgeon.surgery.architecture import output_logits

    model = resolve_source(str(tiny_models[family]), Path.cwd()).load_model()
    ids = torch.randint(3, 300, (1, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits[0]
        hidden = model.base_model(input_ids=ids).last_hidden_state[0]
        chunked = torch.cat([output_logits(model, hidden[i : i + 16]) for i in range(0, 50, 16)])
    assert torch.allclose(chunked, expected, atol=1e-5)
    if family == "gemma3":
        assert expected.abs().max() <= 5.0  # the soft cap really is exercised


def test_log_probabilities_are_a_distribution_to_float_precision():
    # An LM-shaped row: a 49k vocabulary, a few likely tokens, a long tail. Any mass error here
    # enters KL(parent || child) whole, so it must sit far below a real child's KL (~1e-2).
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=generator) * 3
    logits[:, :8] += 12
    mass = log_probabilities(logits.clone()).double().exp().sum(-1)
    assert (mass - 1).abs().max() < 5e-6  # torch.log_softmax: 3e-5 on AVX2
    reference = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(log_probabilities(logits.clone()).double(), reference, atol=1e-5)
