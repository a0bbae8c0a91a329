"""The engine against transformers: greedy tokens equal `generate`'s for every supported family,
through chunked prefill, continuous batching, the prefix cache and preemption; sparse-attention and
VLM exports too. Plus sampling, stop strings, the loop detector, aborts and bad requests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import requires_smollm2, tiny_config
from surgeon.engine import LLM, SamplingParams
from surgeon.engine.stopping import repeating_period
from surgeon.errors import SourceError
from surgeon.modeling import SurgeonSparseLlamaConfig, SurgeonSparseLlamaForCausalLM

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, loop_window=0)


def prompts(count: int, seed: int = 0, vocab: int = 300) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 23, 40, 70, 17, 33, 9, 61][:count]
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, ids: list[int], new: int, **kwargs) -> list[int]:
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    return out[0, len(ids) :].tolist()


def engine_tokens(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [done.token_ids for done in llm.generate(batch, params)]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_tokens_equal_transformers_through_chunked_prefill_and_batching(tiny_models, family):
    folder = tiny_models[family]
    # Blocks of 4 and a 16-token prefill budget: prompts span many blocks and several chunks.
    llm = LLM(str(folder), block_size=4, max_batched_tokens=16, max_num_seqs=4)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = prompts(6)
    assert engine_tokens(llm, batch) == [hf_greedy(hf, ids, 12) for ids in batch]
    assert not llm.has_unfinished() and llm.blocks.num_free == len(llm.blocks.blocks)


def test_other_families_are_refused_with_the_supported_list(tiny_models):
    with pytest.raises(SourceError, match="gemma3_text.*|engine runs llama"):
        LLM(str(tiny_models["gemma3"]))


def test_prefix_cache_reuses_shared_blocks_and_changes_nothing(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    shared = prompts(4)[3][:48]
    first, second = shared + [7, 8, 9], shared + [10, 11]
    engine_tokens(llm, [first])
    before = llm.blocks.hits
    assert engine_tokens(llm, [second]) == [hf_greedy(hf, second, 12)]
    assert llm.blocks.hits - before == 48  # every full block of the shared prefix


def test_preemption_when_the_cache_runs_out_keeps_outputs_exact(tiny_llama):
    # 96 cache positions for four sequences that each grow to 40-80: some must be preempted.
    llm = LLM(str(tiny_llama), block_size=4, kv_cache_tokens=96, max_num_seqs=4)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    batch = [ids[:30] for ids in prompts(4, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, loop_window=0)
    assert engine_tokens(llm, batch, params) == [hf_greedy(hf, ids, 40) for ids in batch]
    assert llm.scheduler.preemptions > 0


def test_sparse_attention_export_matches_transformers(tmp_path, tokenizer_dir):
    torch.manual_seed(0)
    config = SurgeonSparseLlamaConfig(
        sparse_attention={
            "top_k": 8,
            "sinks": 2,
            "window": 3,
            "index_heads": 2,
            "index_dim": 16,
            "rope_dim": 8,
            "layers": [1, 2, 3, 4],
        },
        **tiny_config("llama").to_dict(),
    )
    model = SurgeonSparseLlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.08)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), block_size=4, max_batched_tokens=16)
    assert llm.model.sparse_layers == [1, 2, 3, 4]
    batch = prompts(5, seed=5)  # up to 70 tokens: far more than k = 8 keys per query
    assert engine_tokens(llm, batch) == [hf_greedy(model, ids, 12) for ids in batch]


def test_a_long_prompt_stops_at_the_context_end_unless_overflow_is_refused(tiny_llama):
    """The engine's own API (and the chat demo) stops at the context's end; the server asks for
    refusal, as OpenAI's does, and gets it before anything runs."""
    llm = LLM(str(tiny_llama), kv_cache_tokens=256, block_size=16)
    prompt = list(range(3, 3 + llm.max_model_len - 20))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, loop_window=0)
    (out,) = llm.generate([prompt], params)
    assert out.finish_reason == "length" and len(out.token_ids) == 20
    strict = SamplingParams(temperature=0, max_tokens=128, refuse_overflow=True)
    with pytest.raises(ValueError, match="max_tokens=128 does not fit.*at most 20 new tokens"):
        llm.generate([prompt], strict)
    assert not llm.has_unfinished()


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(tiny_llama):
    llm = LLM(str(tiny_llama))
    batch = prompts(3)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=12, loop_window=0)
    alone = engine_tokens(llm, batch[:1], seeded)
    crowded = engine_tokens(llm, batch, [seeded, GREEDY, GREEDY])  # other rows must not disturb it
    assert alone[0] == crowded[0]
    top1 = SamplingParams(temperature=1.0, top_k=1, seed=1, max_tokens=12, ignore_eos=True, loop_window=0)
    assert engine_tokens(llm, batch, top1) == engine_tokens(llm, batch)


def test_repetition_penalty_matches_transformers(tiny_llama):
    llm = LLM(str(tiny_llama))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True, loop_window=0)
    batch = prompts(2)
    assert engine_tokens(llm, batch, params) == [hf_greedy(hf, ids, 12, repetition_penalty=1.3) for ids in batch]


def test_stop_strings_cut_the_text_and_streams_add_up(tiny_llama):
    llm = LLM(str(tiny_llama))
    ids = prompts(1)[0]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, loop_window=0)
    full = llm.generate([ids], free)[0].text
    streamed = list(llm.stream(ids, free))
    assert "".join(out.text for out in streamed) == full and streamed[-1].finish_reason == "length"
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, loop_window=0, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    parts = list(
        llm.stream(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, loop_window=0, stop=[stop]))
    )
    assert "".join(out.text for out in parts) == cut.text


def test_loop_detector_ends_degenerate_repetition():
    assert repeating_period([5, 6, 7, 8] * 16, 64) == 4
    assert repeating_period([1] * 64, 64) == 1
    assert repeating_period(list(range(64)), 64) is None
    assert repeating_period([1, 2] * 10, 64) is None  # too short to judge
    assert repeating_period([1] * 64, 0) is None  # off


def test_loop_detector_in_the_engine(tiny_llama):
    """A tiny random model falls into a loop quickly; with the detector on, it says so."""
    llm = LLM(str(tiny_llama))
    outs = llm.generate(prompts(6), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, loop_window=16))
    looped = [out for out in outs if out.finish_reason == "loop"]
    assert looped, [out.finish_reason for out in outs]
    for out in looped:
        assert repeating_period(out.token_ids, 16) is not None and len(out.token_ids) < 200


def test_abort_frees_blocks_and_bad_requests_say_why(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4, kv_cache_tokens=256)
    rid = llm.add_request(prompts(1)[0], GREEDY)
    llm.step()
    llm.abort(rid)
    assert not llm.has_unfinished() and llm.blocks.num_free == len(llm.blocks.blocks)
    with pytest.raises(ValueError, match="at most 255 prompt tokens"):
        llm.add_request([5] * 300)
    with pytest.raises(ValueError, match="text-only"):
        llm.add_request([{"role": "user", "content": [{"type": "image"}]}], images=[Image.new("RGB", (8, 8))])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def _tiny_vlm_export(folder, tokenizer_dir, text=None):
    from test_vlm import tiny_vlm

    from surgeon.vision.processor import add_image_token

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_vlm(text=text)
    with torch.no_grad():  # larger than the default init, so the LM's greedy tokens depend on the image
        for param in model.language_model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.08)
    assert add_image_token(tokenizer, model.config.image_token) == model.config.image_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def test_vlm_export_matches_transformers_and_repeated_images_are_free(tmp_path, tokenizer_dir):
    from surgeon.vision.graft import processor_for

    model, tokenizer = _tiny_vlm_export(tmp_path, tokenizer_dir)
    processor = processor_for(model, tokenizer)
    red, blue = Image.new("RGB", (40, 40), (220, 30, 30)), Image.new("RGB", (40, 40), (20, 40, 230))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    llm = LLM(str(tmp_path), block_size=4, max_batched_tokens=8)
    assert llm.is_vlm
    expected = []
    for image in (red, blue):
        inputs = processor.prompt(chat, [image])
        model.generation_config.eos_token_id = None
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    got = [llm.generate([chat], GREEDY, images=[[image]])[0].token_ids for image in (red, blue)]
    assert got == expected and expected[0] != expected[1]
    encoded, hits = llm.vision.encoded, llm.blocks.hits
    again = llm.generate([chat], GREEDY, images=[[red]])[0].token_ids
    assert again == expected[0]
    assert llm.vision.encoded == encoded  # neither re-encoded...
    assert llm.blocks.hits - hits >= model.config.image_seq_length  # ...nor re-prefilled


def test_a_vlm_over_sparse_attention_decodes_like_transformers(tmp_path, tokenizer_dir):
    """The flagship's shape: eyes grafted onto a DSA language model, served with the engine's sparse
    decode path and image prefill (16 image tokens and the chat template: far more than k = 8)."""
    from surgeon.vision.graft import processor_for

    sparse = {"top_k": 8, "sinks": 2, "window": 3, "index_heads": 2, "index_dim": 16, "rope_dim": 8, "layers": [1, 2]}
    text = SurgeonSparseLlamaConfig(sparse_attention=sparse, **tiny_config("llama").to_dict())
    model, tokenizer = _tiny_vlm_export(tmp_path, tokenizer_dir, text=text)
    processor = processor_for(model, tokenizer)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]}]
    llm = LLM(str(tmp_path), block_size=4, max_batched_tokens=8)
    assert llm.is_vlm and llm.model.sparse_layers == [1, 2]
    for image in (Image.new("RGB", (40, 40), (220, 30, 30)), Image.new("RGB", (40, 40), (20, 40, 230))):
        inputs = processor.prompt(chat, [image])
        assert inputs["input_ids"].shape[1] > 2 * sparse["top_k"]
        model.generation_config.eos_token_id = None
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert llm.generate([chat], GREEDY, images=[[image]])[0].token_ids == expected


def test_llava_layout_export_matches_transformers(tmp_path, tokenizer_dir):
    from transformers import LlavaForConditionalGeneration

    from surgeon.vision.export import hf_processor, to_llava
    from surgeon.vision.graft import image_chat_template

    vlm, tokenizer = _tiny_vlm_export(tmp_path / "surgeon", tokenizer_dir)
    tokenizer.chat_template = image_chat_template(tokenizer.chat_template, vlm.config.image_token)
    to_llava(vlm).save_pretrained(tmp_path / "llava")
    llava = LlavaForConditionalGeneration.from_pretrained(tmp_path / "llava", dtype=torch.float32).eval()
    processor = hf_processor(vlm.config, tokenizer)
    processor.save_pretrained(tmp_path / "llava")
    image = Image.new("RGB", (40, 40), (30, 200, 60))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    inputs = processor(
        images=[image], text=processor.apply_chat_template(chat, add_generation_prompt=True), return_tensors="pt"
    )
    llava.generation_config.eos_token_id = None
    want = llava.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=0)
    llm = LLM(str(tmp_path / "llava"), block_size=4)
    assert llm.is_vlm
    assert (
        llm.generate([chat], GREEDY, images=[[image]])[0].token_ids == want[0, inputs["input_ids"].shape[1] :].tolist()
    )


def _placeholder_runs(ids: list[int], image_id: int) -> int:
    return sum(1 for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != image_id))


def test_a_typed_image_placeholder_is_text_never_an_image_slot(tmp_path, tokenizer_dir):
    """Only image parts make image slots: "<image>" typed in a message (or a plain prompt) is
    tokenised as the characters it is, for surgeon's VLM and for the LLaVA layout alike."""
    from surgeon.vision.export import hf_processor, to_llava
    from surgeon.vision.graft import image_chat_template

    vlm, tokenizer = _tiny_vlm_export(tmp_path / "surgeon", tokenizer_dir)
    tokenizer.chat_template = image_chat_template(tokenizer.chat_template, vlm.config.image_token)
    to_llava(vlm).save_pretrained(tmp_path / "llava")
    hf_processor(vlm.config, tokenizer).save_pretrained(tmp_path / "llava")
    image = Image.new("RGB", (40, 40), (30, 200, 60))
    typed = "Is <image> a tag? <image>"
    with_image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": typed}]}]
    for folder in (tmp_path / "surgeon", tmp_path / "llava"):
        llm = LLM(str(folder), block_size=4)
        image_id = llm.vision.image_token_id
        ids, spans = llm.encode(with_image, [image])
        assert len(spans) == 1 and _placeholder_runs(ids, image_id) == 1, folder.name
        assert llm.generate([with_image], GREEDY, images=[[image]])[0].token_ids
        for text_only in ([{"role": "user", "content": typed}], typed):
            ids, spans = llm.encode(text_only)
            assert not spans and image_id not in ids, (folder.name, text_only)
            assert llm.generate([text_only], GREEDY)[0].token_ids


@pytest.mark.real_model
@requires_smollm2
def test_real_smollm2_chats_equal_transformers_generate():
    from surgeon.checkpoints.sources import resolve_source

    llm = LLM("smollm2-135m-instruct", kv_cache_tokens=2048)
    source = resolve_source("smollm2-135m-instruct", Path.cwd())
    hf = source.load_model()
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primes."]
    chats = [[{"role": "user", "content": question}] for question in questions]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, loop_window=0)
    got = [out.token_ids for out in llm.generate(chats, params)]
    want = [hf_greedy(hf, llm.encode(chat)[0], 24) for chat in chats]
    assert got == want
    assert "Paris" in llm.tokenizer.decode(got[0])


def test_int8_weights_stay_close_to_full_precision(tiny_llama):
    from surgeon.engine.quantize import Int8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=True)
    x = torch.randn(5, 64)
    error = (Int8Linear.from_linear(linear)(x) - linear(x)).norm() / linear(x).norm()
    assert error < 0.01
    full, quantized = LLM(str(tiny_llama)), LLM(str(tiny_llama), quantize="int8")
    assert isinstance(quantized.model.layers[0].mlp.down, Int8Linear)
    batch = prompts(6)
    same = sum(a[:4] == b[:4] for a, b in zip(engine_tokens(full, batch), engine_tokens(quantized, batch)))
    assert same >= 4  # the first tokens of most prompts survive int8
    with pytest.raises(ValueError, match="quantize"):
        LLM(str(tiny_llama), quantize="int3")


def test_compiled_decoding_gives_the_same_tokens(tiny_llama):
    batch = prompts(3)
    eager = engine_tokens(LLM(str(tiny_llama)), batch)
    compiled = LLM(str(tiny_llama), compile=True)
    assert engine_tokens(compiled, batch) == eager
    assert engine_tokens(compiled, batch[:1]) == eager[:1]  # batch 1 is a shape of its own


def test_sampling_draws_from_the_filtered_distribution():
    """The one-uniform inverse-CDF draw matches softmax(logits / T) after top-k/top-p, over many draws."""
    from surgeon.engine.sampler import sample
    from surgeon.engine.sequence import Sequence

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0, 1.5, 0.2])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, seed=11, max_tokens=1)
    expected = (logits / 0.8).masked_fill(logits < logits.topk(6).values[-1], -torch.inf).softmax(-1)
    ordered, order = expected.sort(descending=True)
    ordered[(ordered.cumsum(-1) - ordered) >= 0.95] = 0
    expected = torch.zeros_like(expected).scatter(0, order, ordered)
    expected /= expected.sum()
    seq = Sequence([1, 2], params)
    draws = torch.tensor([sample(logits[None], [seq])[0] for _ in range(20000)])
    observed = torch.bincount(draws, minlength=8).float() / len(draws)
    assert 0.5 * (observed - expected).abs().sum() < 0.015  # total variation; ~0.006 expected from noise
    assert observed[expected == 0].sum() == 0  # filtered tokens are never drawn
