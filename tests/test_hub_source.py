"""Sources named by a Hugging Face Hub id: read from the Hub's cache (here a cache built by the test,
offline), and a clear error when the Hub cannot provide one."""

from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest
import torch

from surgeon.checkpoints.sources import resolve_source
from surgeon.errors import SourceError


@pytest.fixture
def hub_cache(tmp_path, tiny_llama, monkeypatch):
    """An offline Hub cache holding tiny-org/tiny-llama at one revision, laid out as the Hub lays it out."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_llama, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_cached_hub_id_loads_like_a_folder(hub_cache, tmp_path, tiny_llama):
    source = resolve_source("tiny-org/tiny-llama", tmp_path)
    assert source.kind == "hub" and source.hub_id == "tiny-org/tiny-llama"
    assert source.config.num_hidden_layers == 6
    assert source.folder() == hub_cache
    model = source.load_model()
    reference = resolve_source(str(tiny_llama), tmp_path).load_model()
    ids = torch.tensor([[1, 5, 9, 13]])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_an_unreachable_hub_id_says_what_to_do(hub_cache, tmp_path):
    source = resolve_source("tiny-org/not-there", tmp_path)
    with pytest.raises(SourceError) as caught:
        _ = source.config
    message = str(caught.value)
    assert "neither a surgeon alias nor a local folder" in message
    assert "huggingface-cli download tiny-org/not-there" in message


def test_the_fingerprint_follows_the_revision(hub_cache, tmp_path):
    before = resolve_source("tiny-org/tiny-llama", tmp_path).fingerprint()
    newer = hub_cache.parent / "fedcba9876543210fedcba9876543210fedcba98"
    shutil.copytree(hub_cache, newer)
    (hub_cache.parent.parent / "refs" / "main").write_text(newer.name)
    assert resolve_source("tiny-org/tiny-llama", tmp_path).fingerprint() != before


def test_a_snapshot_holding_only_the_config_is_not_taken_for_the_model(hub_cache, tmp_path):
    for file in hub_cache.iterdir():
        if file.name != "config.json":
            file.unlink()  # as after `plan`, which fetches config.json alone
    source = resolve_source("tiny-org/tiny-llama", tmp_path)
    assert source.config.num_hidden_layers == 6
    with pytest.raises(SourceError, match="could not be fetched"):
        source.folder()  # offline: the weights are missing, so it must try to fetch them
