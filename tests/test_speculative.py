"""Speculative decoding in the engine: greedy output token-identical with and without speculation
for each draft kind and each model kind, the sampled distribution exactly the target's, and
preemption, aborts and stops in the middle of speculative steps losing nothing."""

from __future__ import annotations

import itertools

import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import save_tiny_model, tiny_config
from surgeon.engine import LLM, SamplingParams
from surgeon.engine.speculative import Proposal, SpeculativeConfig, accept
from surgeon.errors import SourceError
from surgeon.modeling import SurgeonSparseLlamaConfig, SurgeonSparseLlamaForCausalLM

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, loop_window=0)
SMALL = {"block_size": 4, "max_batched_tokens": 32, "max_num_seqs": 4}


def twenty_prompts(vocab: int = 300) -> list[list[int]]:
    """20 prompts of 6-90 tokens; half repeat a phrase of their own, as quoting text does, so the
    n-gram draft has matches to propose and the verifier has drafts both to keep and to reject."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for i in range(20):
        length = 6 + (i * 17) % 85
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
        if i % 2:
            ids = ids + ids[: length // 2] + ids[: length // 3]
        out.append(ids)
    return out


def outputs(llm: LLM, batch, params=GREEDY):
    done = llm.generate(batch, params)
    return [d.token_ids for d in done], done


def first_layers(target, folder, keep: int = 3):
    """The target cut to its first `keep` layers: a draft such as surgery makes, right often
    enough to be kept and wrong often enough to be rejected."""
    import surgeon.modeling  # noqa: F401  (the sparse class)

    model = AutoModelForCausalLM.from_pretrained(target)
    model.model.layers = model.model.layers[:keep]
    model.config.num_hidden_layers = keep
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(target).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def draft_llama(tmp_path_factory, tiny_llama):
    return first_layers(tiny_llama, tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def mqa_llama(tmp_path_factory, tokenizer_dir):
    return save_tiny_model(tmp_path_factory.mktemp("mqa"), "llama", tokenizer_dir, num_key_value_heads=1)


@pytest.fixture(scope="module")
def sparse_llama(tmp_path_factory, tokenizer_dir):
    torch.manual_seed(0)
    sparse = {"top_k": 8, "sinks": 2, "window": 3, "index_heads": 2, "index_dim": 16, "rope_dim": 8, "layers": [1, 2]}
    model = SurgeonSparseLlamaForCausalLM(
        SurgeonSparseLlamaConfig(sparse_attention=sparse, **tiny_config("llama").to_dict())
    )
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.08)
    folder = tmp_path_factory.mktemp("sparse")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["gqa", "mqa", "dsa"])
@pytest.mark.parametrize("method", ["ngram", "model"])
def test_greedy_output_is_token_identical_with_and_without_speculation(
    kind, method, tiny_llama, mqa_llama, sparse_llama, draft_llama, tmp_path
):
    target = {"gqa": tiny_llama, "mqa": mqa_llama, "dsa": sparse_llama}[kind]
    if method == "ngram":
        speculative = {"method": "ngram", "k": 4}
    else:
        draft = draft_llama if kind == "gqa" else first_layers(target, tmp_path / "draft")
        # A tiny draft costs what the tiny target does (both are per-call overhead), so the
        # planner would rightly stop proposing; exactness is tested at a fixed k.
        speculative = {"method": "model", "draft": str(draft), "adaptive": False}
    batch = twenty_prompts()
    plain, _ = outputs(LLM(str(target), **SMALL), batch)
    llm = LLM(str(target), speculative=speculative, **SMALL)
    fast, done = outputs(llm, batch)
    assert fast == plain
    proposed = sum(d.speculation["proposed"] for d in done)
    accepted = sum(d.speculation["accepted"] for d in done)
    assert proposed > 0 and 0 < accepted < proposed  # drafts were both kept and rejected
    rejected = sum(d.speculation["rejected"] for d in done)
    assert 0 < rejected <= proposed - accepted  # a rejection drops its token and every one after it
    steps = sum(d.speculation["target_steps"] for d in done)
    assert steps < sum(len(t) for t in fast)  # fewer target forwards than tokens
    # Every rejected tail's blocks came back; the draft's mirrors are gone with their requests.
    assert llm.blocks.num_free == len(llm.blocks.blocks)
    if method == "model":
        draft = llm.speculator.draft
        assert not draft.mirrors and draft.engine.blocks.num_free == len(draft.engine.blocks.blocks)


@pytest.mark.parametrize("compile", [False, True])
def test_the_target_as_its_own_draft_is_always_accepted(compile, tiny_llama):
    """Every proposal kept shows the draft's logits are right in each of its paths: the prompt's
    prefill, the catch-up on the tokens a verification kept (a verification-shaped decode step),
    and single-token rounds; compiled, the draft's engine is compiled with its target's."""
    spec = {"method": "model", "draft": str(tiny_llama), "k": 3, "adaptive": False}
    llm = LLM(str(tiny_llama), speculative=spec, compile=compile, **SMALL)
    assert llm.speculator.draft.engine.runner.compiled == compile
    fast, done = outputs(llm, twenty_prompts()[:6])
    assert fast == outputs(LLM(str(tiny_llama), **SMALL), twenty_prompts()[:6])[0]
    assert all(d.speculation["accepted"] == d.speculation["proposed"] > 0 for d in done)


def test_greedy_speculation_equals_transformers_generate(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    batch = twenty_prompts()[:8]
    llm = LLM(str(tiny_llama), speculative="ngram", **SMALL)
    expected = [
        hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)[0, len(ids) :].tolist()
        for ids in batch
    ]
    assert outputs(llm, batch)[0] == expected


def test_a_vlm_speculates_without_proposing_image_slots(tmp_path, tokenizer_dir):
    from test_engine import _tiny_vlm_export

    _tiny_vlm_export(tmp_path, tokenizer_dir)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this? " * 3}]}]
    images = [[Image.new("RGB", (40, 40), colour)] for colour in ((220, 30, 30), (20, 40, 230))]
    plain = LLM(str(tmp_path), block_size=4)
    fast = LLM(str(tmp_path), block_size=4, speculative="ngram")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, loop_window=0)
    expected = [d.token_ids for d in plain.generate([chat, chat], params, images=images)]
    done = fast.generate([chat, chat], params, images=images)
    assert [d.token_ids for d in done] == expected
    assert sum(d.speculation["proposed"] for d in done) > 0
    assert all(fast.vision.image_token_id not in d.token_ids for d in done)


def test_preemption_and_abort_in_the_middle_of_speculation_lose_nothing(tiny_llama, draft_llama):
    batch = [ids[:30] for ids in twenty_prompts()[1::2][:4]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, loop_window=0)
    expected, _ = outputs(LLM(str(tiny_llama), block_size=4, max_num_seqs=4), batch, params)
    for speculative in ("ngram", {"method": "model", "draft": str(draft_llama), "adaptive": False}):
        # 112 positions for four sequences growing to ~70: preemptions while speculating.
        llm = LLM(str(tiny_llama), block_size=4, kv_cache_tokens=112, max_num_seqs=4, speculative=speculative)
        assert outputs(llm, batch, params)[0] == expected
        assert llm.scheduler.preemptions > 0
        assert llm.blocks.num_free == len(llm.blocks.blocks)
        # Abort one request after a few speculative steps: the others finish unchanged.
        ids = [llm.add_request(p, params) for p in batch]
        got = {rid: [] for rid in ids}
        for _ in range(4):
            for out in llm.step():
                got[out.request_id].extend(out.token_ids)
        llm.abort(ids[1])
        while llm.has_unfinished():
            for out in llm.step():
                got[out.request_id].extend(out.token_ids)
        assert [got[rid] for rid in ids[::2]] == expected[::2] and got[ids[3]] == expected[3]
        assert expected[1][: len(got[ids[1]])] == got[ids[1]]
        assert llm.blocks.num_free == len(llm.blocks.blocks)
        if llm.speculator.draft.costs_rounds:
            assert not llm.speculator.draft.mirrors


def test_stop_strings_and_max_tokens_inside_an_accepted_run(tiny_llama):
    batch = twenty_prompts()[1::2][:6]
    for max_tokens in (1, 2, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, loop_window=0)
        plain, _ = outputs(LLM(str(tiny_llama), **SMALL), batch, params)
        fast, _ = outputs(LLM(str(tiny_llama), speculative="ngram", **SMALL), batch, params)
        assert fast == plain and all(len(t) == max_tokens for t in fast)
    plain_llm = LLM(str(tiny_llama), **SMALL)
    text = plain_llm.generate(batch[:1], GREEDY)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, loop_window=0, stop=(stop,))
        expected = plain_llm.generate(batch[:1], params)[0]
        got = LLM(str(tiny_llama), speculative="ngram", **SMALL).generate(batch[:1], params)[0]
        assert (
            (got.text, got.finish_reason)
            == (expected.text, expected.finish_reason)
            == (text[: text.find(stop)], "stop")
        )


def _exact_joint(model, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple, float]:
    """P(first `length` tokens) under the engine's sampling rule, by enumeration (top_k keeps it small)."""
    from surgeon.engine.sampler import distribution

    joint = {}
    frontier = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in frontier.items():
            ids = torch.tensor([prompt + list(prefix)])
            with torch.no_grad():
                logits = model(ids).logits[0, -1].float()
            probs = distribution(logits, params, prompt + list(prefix))
            for token in probs.nonzero().flatten().tolist():
                grown[(*prefix, token)] = mass * float(probs[token])
        frontier = grown
    joint.update(frontier)
    return joint


def _tv(counts: dict, exact: dict, n: int) -> float:
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


@pytest.mark.parametrize("method", ["ngram", "model"])
def test_sampled_output_has_exactly_the_targets_distribution(method, tiny_llama, draft_llama):
    """3,000 samples of the first three tokens (top-k 3, T 1.3, a repetition penalty): the total
    variation distance to the exact distribution stays at sampling noise, while the draft's own
    distribution is far from it (so accepting drafts blindly would fail)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    # Every token occurs in the prompt, so whatever is sampled the n-gram draft finds a continuation.
    prompt = twenty_prompts()[3][:20] + list(range(3, 320))
    make = lambda seed: SamplingParams(
        temperature=1.3, top_k=3, repetition_penalty=1.2, max_tokens=3, ignore_eos=True, loop_window=0, seed=seed
    )
    exact = _exact_joint(model, prompt, make(0), 3)
    speculative = {"method": "ngram", "adaptive": False}
    if method == "model":
        speculative = {"method": "model", "draft": str(draft_llama), "k": 2, "adaptive": False}
    llm = LLM(str(tiny_llama), max_num_seqs=64, speculative=speculative)
    n = 3000
    done = llm.generate([prompt] * n, [make(seed) for seed in range(n)])
    counts = {}
    for d in done:
        counts[tuple(d.token_ids)] = counts.get(tuple(d.token_ids), 0) + 1
    # At least the second token of each is drafted (more where the prefix cache leaves only the
    # prompt's last token, which a speculative step then runs with drafts after it).
    assert sum(d.speculation["proposed"] for d in done) >= n
    if method == "model":  # (the n-gram's proposals here are rarely in the top 3: its rejections are tested)
        assert sum(d.speculation["accepted"] for d in done) > 0
    assert _tv(counts, exact, n) < 0.05  # ~0.03 from noise over 27 outcomes at n = 3000
    if method == "model":
        drafted = _exact_joint(AutoModelForCausalLM.from_pretrained(draft_llama).eval(), prompt, make(0), 3)
        assert 0.5 * sum(abs(drafted.get(k, 0) - exact.get(k, 0)) for k in set(drafted) | set(exact)) > 0.2


def test_the_rejection_rule_on_one_position():
    """accept() against the closed form: P(token) = q(t) min(1, p/q) + P(reject) residual(t), for a
    draft with a distribution and for a point-mass (n-gram) draft alike: either way the first token
    is distributed as p."""
    from surgeon.engine.sequence import Sequence

    p_logits = torch.tensor([[1.0, 0.2, -0.5, 0.0], [0.3, 0.1, 0.0, -1.0]])
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1]])
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=3)
    p = p_logits[0].softmax(-1)
    draws = 20000
    generator = torch.Generator().manual_seed(5)
    for point_mass in (False, True):
        counts = torch.zeros(4)
        for i in range(draws):
            drafted = i % 4 if point_mass else int(torch.multinomial(q[0], 1, generator=generator))
            seq = Sequence([1, 2, 3], params)
            seq.generator = generator
            first = accept(p_logits, seq, Proposal([drafted], None if point_mass else q))[0]
            counts[first] += 1
        assert 0.5 * (counts / draws - p).abs().sum() < 0.015


def test_adaptive_k_backs_off_where_drafts_are_wrong(tiny_llama):
    """Prompts with nothing to look up: after a few failed proposals the planner proposes less."""
    llm = LLM(str(tiny_llama), speculative={"method": "ngram", "k": 8}, **SMALL)
    batch = [list(range(3 + i, 60 + i)) for i in range(4)]  # no repeated n-gram in the prompt
    done = llm.generate(batch, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, loop_window=0))
    for d in done:
        info = d.speculation
        assert info["target_steps"] >= len(d.token_ids) // 2
        if info["proposed"]:
            assert info["proposed"] < 8 * info["target_steps"]


def test_bad_speculative_settings_say_what_is_wrong(tiny_llama, tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.parse({"method": "medusa"})
    with pytest.raises(ValueError, match="needs `draft`"):
        SpeculativeConfig.parse({"method": "model"})
    with pytest.raises(ValueError, match="k must be"):
        SpeculativeConfig.parse({"k": 0})
    with pytest.raises(ValueError, match="unknown speculative settings: tokens"):
        SpeculativeConfig.parse({"tokens": 3})
    # A draft whose tokenizer differs from the target's is refused, naming a difference.
    other = tmp_path / "other"
    save_tiny_model(other, "llama", tokenizer_dir, layers=2)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(SourceError, match="tokenizer differs"):
        LLM(str(tiny_llama), speculative=str(other))


def test_k_positions_are_planned_in_order_and_within_room():
    from surgeon.engine.sequence import Sequence
    from surgeon.engine.speculative import Planner

    planner = Planner(SpeculativeConfig(k=5), draft_costs_rounds=False)
    seqs = [Sequence([1, 2, 3], GREEDY) for _ in range(3)]
    for seq, rate in zip(seqs, (0.95, 0.5, 0.05)):
        seq.spec.rate = rate
    assert planner.plan(seqs, [9, 9, 9]) == [5, 5, 5]  # nothing measured yet: full k
    for tokens, seconds in itertools.product((3, 8, 15), (0.0,)):
        planner.costs.observe(tokens, 0.030 + 0.002 * tokens + seconds)
    ks = planner.plan(seqs, [9, 2, 9])
    assert ks[0] == 5 and ks[1] <= 2 and ks[2] == 0 and ks[0] >= ks[1] >= ks[2]


def test_a_compile_stall_does_not_price_a_draft_out_for_good():
    """torch.compile's first call of a new shape takes seconds where a step takes milliseconds:
    such a step is left out of the cost model, and a draft declined anyway is tried again."""
    from surgeon.engine.sequence import Sequence
    from surgeon.engine.speculative import Planner

    planner = Planner(SpeculativeConfig(k=4), draft_costs_rounds=True)
    seq = Sequence([1, 2, 3], GREEDY)
    seq.spec.rate = 0.5
    for tokens in (1, 1, 2, 3, 5, 1, 2):
        planner.costs.observe(tokens, 0.025 + 0.0013 * tokens)
    planner.costs.observe(3, 12.4)  # a compile
    for seconds in (4.2, 0.006, 0.007):
        planner.costs.observe_draft(1, seconds)
    a, b, c = planner.costs.fit()
    assert a == pytest.approx(0.025, rel=0.01) and b == pytest.approx(0.0013, rel=0.01) and c == 0.0
    assert planner.costs.draft_round == pytest.approx(0.007)
    assert planner.plan([seq], [9])[0] >= 1  # a 7 ms draft round for a 25 ms step is worth it

    planner.costs.draft_rounds.clear()
    planner.costs.observe_draft(1, 4.2)  # only a stall measured: the draft is declined ...
    plans = [planner.plan([seq], [9])[0] for _ in range(Planner.PROBE_EVERY)]
    assert plans[:-1] == [0] * (Planner.PROBE_EVERY - 1)
    assert plans[-1] == 1  # ... until one position is tried again, which re-measures it


def test_probes_of_a_declined_draft_wait_longer_each_time_until_the_plan_takes_it_up():
    """Each probe costs the draft a catch-up prefill, so while the plan keeps declining the draft
    the waits double (32, 64, 128, ... up to PROBE_MOST); a plan that speculates on its own
    brings the wait back to 32."""
    from surgeon.engine.sequence import Sequence
    from surgeon.engine.speculative import Planner

    planner = Planner(SpeculativeConfig(k=4), draft_costs_rounds=True)
    seq = Sequence([1, 2, 3], GREEDY)
    for tokens in (1, 2, 1, 3):
        planner.costs.observe(tokens, 0.020 + 0.001 * tokens)
    planner.costs.observe_draft(1, 0.015)

    def probes(steps: int) -> list[int]:
        return [step for step in range(1, steps + 1) if planner.plan([seq], [9])[0]]

    seq.spec.rate = 0.2  # a 15 ms draft round for a 21 ms step at acceptance 0.2: declined
    waits = probes(32 + 64 + 128 + 256 + 512 + 512)
    assert [b - a for a, b in zip([0, *waits], waits)] == [32, 64, 128, 256, 512, 512]
    seq.spec.rate = 0.95  # the probes found a draft that agrees: the plan takes it up ...
    assert planner.plan([seq], [9])[0] >= 2
    seq.spec.rate = 0.2  # ... and when it is declined again, the first wait is 32 once more
    assert probes(40) == [32]

    # An n-gram costs no round and its probe no catch-up: it is probed too (its c, like a model
    # draft's, outlives the window), every 32 idle steps without growing waits.
    planner = Planner(SpeculativeConfig(k=4), draft_costs_rounds=False)
    for tokens, verify in ((1, False), (2, False), (1, False), (3, True), (5, True)):
        planner.costs.observe(tokens, 0.020 + 0.001 * tokens + (0.030 if verify else 0.0), verify)
    assert probes(32 * 4) == [32, 64, 96, 128]
    assert planner.plan([seq], [0]) == [0]  # nothing found: nothing to probe with


def test_break_even_is_the_acceptance_from_which_the_plan_speculates():
    """`break_even` bisects the planner's own decision: just above it a sequence at that acceptance
    gets draft tokens, just below it none; a dearer draft round or verification raises it."""
    from surgeon.engine.sequence import Sequence
    from surgeon.engine.speculative import Planner

    planner = Planner(SpeculativeConfig(k=4), draft_costs_rounds=True)
    assert planner.break_even() is None  # nothing measured yet
    for tokens, verify in ((1, False), (2, False), (1, False), (5, True), (3, True)):
        planner.costs.observe(tokens, 0.025 + 0.0013 * tokens + (0.004 if verify else 0.0), verify)
    planner.costs.observe_draft(1, 0.007)
    cheap = planner.break_even()
    assert 0.05 < cheap < 0.95
    seq = Sequence([1, 2, 3], GREEDY)
    seq.spec.rate = cheap + 0.01
    assert planner.plan([seq], [9])[0] >= 1
    seq.spec.rate = cheap - 0.01
    assert planner.plan([seq], [9])[0] == 0
    planner.costs.observe_draft(1, 0.012)  # the median of 7, 12 and 12 ms rounds is now 12 ms
    planner.costs.observe_draft(1, 0.012)
    assert planner.break_even() > cheap
    free = Planner(SpeculativeConfig(k=4), draft_costs_rounds=False)  # an n-gram lookup pays no round
    free.costs.samples.extend(planner.costs.samples)
    assert free.break_even() < cheap
    never = Planner(SpeculativeConfig(k=4), draft_costs_rounds=True)
    never.costs.observe(1, 0.010)
    never.costs.observe_draft(1, 0.050)  # a draft round five times a target step never pays
    assert never.break_even() is None


def test_a_declined_model_draft_is_not_timed_again_and_new_requests_start_at_its_acceptance(tiny_llama, draft_llama):
    """Round times are recorded only from steps where the draft ran (a declined step re-recorded
    the last propose's times, filling the median with copies of one measurement), and a model
    draft's new sequences start from the acceptance it has shown, not from the fixed prior that
    kept re-engaging a weak draft; an n-gram lookup, free to retry, keeps the prior."""
    from surgeon.engine.sequence import Speculation

    config = {"method": "model", "draft": str(draft_llama), "k": 4, "adaptive": False}  # planned full, then none
    llm = LLM(str(tiny_llama), speculative=config, **SMALL)
    speculator, draft = llm.speculator, llm.speculator.draft
    plan, propose, observe_draft = speculator.planner.plan, draft.propose, speculator.planner.costs.observe_draft
    counts = {"plans": 0, "declined": 0, "rounds_run": 0, "rounds_recorded": 0}

    def every_other_plan_declined(seqs, room):
        counts["plans"] += 1
        ks = plan(seqs, room) if counts["plans"] % 2 else [0] * len(seqs)
        counts["declined"] += not any(ks)
        return ks

    def propose_and_count(seqs, ks):
        proposals = propose(seqs, ks)
        counts["rounds_run"] += len(draft.round_seconds)
        return proposals

    def record_and_count(rounds, seconds):
        counts["rounds_recorded"] += 1
        observe_draft(rounds, seconds)

    speculator.planner.plan = every_other_plan_declined
    draft.propose = propose_and_count
    speculator.planner.costs.observe_draft = record_and_count
    llm.generate(twenty_prompts()[:4], GREEDY)
    assert counts["declined"] >= 10 and counts["rounds_run"] >= 10
    assert counts["rounds_recorded"] == counts["rounds_run"]

    assert speculator.overall.proposed > 0 and speculator.overall.rate != Speculation.PRIOR
    llm.add_request([5, 6, 7, 8], GREEDY, request_id="late")
    assert llm.requests["late"].spec.rate == speculator.overall.rate
    ngram = LLM(str(tiny_llama), speculative={"method": "ngram", "k": 4}, **SMALL)
    ngram.generate(twenty_prompts()[:4], GREEDY)
    ngram.add_request([5, 6, 7, 8], GREEDY, request_id="late")
    assert ngram.requests["late"].spec.rate == Speculation.PRIOR


def test_a_verifications_fixed_cost_is_fitted_apart_and_can_price_speculation_out():
    """Times shaped like 16 sequences on this CPU: a plain step 84 + 2.4 ms a token, a verification
    12 ms more. One line through both kinds of step prices the plain step too high, and speculation
    at acceptance 0.4 then looks like a gain; fitted apart, it is declined. At batch 1, where a
    step is mostly weight reads, the same costs still buy speculation at high acceptance."""
    from surgeon.engine.sequence import Sequence
    from surgeon.engine.speculative import Planner, StepCosts

    costs = StepCosts()
    for tokens in (16, 15, 16, 14, 16):
        costs.observe(tokens, 0.084 + 0.0024 * tokens)
    for tokens in (20, 24, 31, 40, 26):
        costs.observe(tokens, 0.084 + 0.0024 * tokens + 0.012, verify=True)
    a, b, c = costs.fit()
    assert (a, b, c) == pytest.approx((0.084, 0.0024, 0.012), rel=1e-6)

    planner = Planner(SpeculativeConfig(k=4), draft_costs_rounds=False)
    planner.costs = costs
    crowd = [Sequence([1, 2, 3], GREEDY) for _ in range(16)]
    for seq in crowd:
        seq.spec.rate = 0.4
    assert planner.plan(crowd, [9] * 16) == [0] * 16
    # The old single line: its slope and intercept make the same plan look worth it.
    lumped = StepCosts()
    lumped.samples.extend((t, False, s) for t, _, s in costs.samples)
    a1, b1, _ = lumped.fit()
    assert a1 + b1 * 16 > a + b * 16 and 0.4 / b1 > 16 / (a1 + b1 * 16)

    alone = Sequence([1, 2, 3], GREEDY)
    alone.spec.rate = 0.8
    assert planner.plan([alone], [9])[0] >= 3


def test_a_verifications_cost_outlives_the_window_that_measured_it():
    """Once a declined draft's verifications leave the 64-step window, the last measured c stands:
    read as 0 it priced verifications as free, lowered the break-even and took the draft up again.
    Verifications alone in the window give a as theirs less that c."""
    from surgeon.engine.sequence import Sequence
    from surgeon.engine.speculative import Planner

    planner = Planner(SpeculativeConfig(k=4), draft_costs_rounds=True)
    planner.costs.observe_draft(1, 0.017)
    for tokens in (1, 1, 1, 1):
        planner.costs.observe(tokens, 0.075 + 0.004 * tokens)
    for tokens in (3, 4, 5, 2):
        planner.costs.observe(tokens, 0.075 + 0.004 * tokens + 0.047, verify=True)
    assert planner.costs.prices_c and planner.costs.fit() == pytest.approx((0.075, 0.004, 0.047), rel=1e-6)
    bar = planner.break_even()
    assert 0.5 < bar < 0.9  # the eager costs of run 6: the draft needs ~0.67 per token

    for step in range(planner.costs.samples.maxlen):  # declined: plain steps only from here on
        planner.costs.observe(1 + step % 2, 0.075 + 0.004 * (1 + step % 2))
    assert not any(verify for _, verify, _ in planner.costs.samples)
    assert planner.costs.fit() == pytest.approx((0.075, 0.004, 0.047), rel=1e-6)
    assert planner.break_even() == pytest.approx(bar)
    below = Sequence([1, 2, 3], GREEDY)
    below.spec.rate = bar - 0.05
    assert planner._choose([below.spec.rate], [4], planner.costs.fit()) == [0]
    # Read as 0, the same window would have taken this draft up:
    assert planner._choose([below.spec.rate], [4], (0.075, 0.004, 0.0)) != [0]

    for tokens in (3, 4, 5, 2) * 16:  # verifications only: a is theirs less the known c
        planner.costs.observe(tokens, 0.075 + 0.004 * tokens + 0.047, verify=True)
    assert planner.costs.fit() == pytest.approx((0.075, 0.004, 0.047), rel=1e-6)


def _simulated_answers(acceptance: float, answers: int = 8, new: int = 128, k: int = 4) -> tuple[float, float]:
    """The planner and the acceptance estimates against a draft whose tokens are each kept with
    probability `acceptance`, priced with a compiled SmolLM2-135M's measured costs (a 35 ms step,
    0.9 ms a token, 12.7 ms a verification, 5.6 ms a draft round): (tokens per target step, time
    against plain decoding's)."""
    import random

    from surgeon.engine.sequence import Sequence, Speculation
    from surgeon.engine.speculative import Planner

    a, b, c, draft_round = 0.0342, 0.0009, 0.0127, 0.0056
    draws = random.Random(0)
    planner = Planner(SpeculativeConfig(k=k), draft_costs_rounds=True)
    overall = Speculation(memory=0.99)
    seconds = steps = made = 0
    for _ in range(answers):
        seq = Sequence([1, 2, 3], GREEDY)
        seq.spec.start_from(overall.rate)
        written = 0
        while written < new:
            proposed = planner.plan([seq], [min(k, new - written - 1)])[0]
            kept = 0
            while kept < proposed and draws.random() < acceptance:
                kept += 1
            forward = a + b * (1 + proposed) + (c if proposed else 0.0)
            planner.costs.observe(1 + proposed, forward, verify=proposed > 0)
            for _ in range(proposed):
                planner.costs.observe_draft(1, draft_round)
            seq.spec.observe(proposed, kept)
            overall.observe(proposed, kept)
            if not proposed:
                seq.spec.drift(overall.rate)
            seconds += forward + draft_round * proposed
            steps += 1
            written += kept + 1
            made += kept + 1
    return made / steps, (a + b) * made / seconds


def test_a_draft_that_pays_stays_engaged_and_one_that_does_not_costs_little():
    """With these costs the bar is ~0.49 per token. A draft kept 70% of the time is worth ~1.3x
    (k = 3 or 4 at a fixed k); the estimate averaged per proposal (0.3 of the way each time) lost
    most of that to noise: one rejection took it under the bar, the draft was declined and not
    tested again for tens of steps (1.13 tokens a target step, 1.04x). Counted, it stays engaged;
    a draft under the bar is tried and dropped at a small cost."""
    tokens_per_step, speed = _simulated_answers(0.7)
    assert tokens_per_step > 2.0 and speed > 1.2
    tokens_per_step, speed = _simulated_answers(0.85)
    assert tokens_per_step > 3.0 and speed > 1.6
    tokens_per_step, speed = _simulated_answers(0.3)
    assert tokens_per_step < 1.1 and speed > 0.95


def test_the_ngram_draft_looks_first_and_the_planner_chooses_among_tokens_found(tiny_llama):
    """A free draft proposes before planning: a sequence whose lookup finds nothing is no
    candidate (planned blind it counted as a likely gain), and what the planner keeps is a prefix
    of what was found."""
    llm = LLM(str(tiny_llama), speculative="ngram", **SMALL)
    planner, draft = llm.speculator.planner, llm.speculator.draft
    seen = []
    plan, propose = planner.plan, draft.propose

    def recording_propose(seqs, ks):
        found = propose(seqs, ks)
        seen.append({"found": [len(p.tokens) for p in found]})
        return found

    def recording_plan(seqs, room):
        ks = plan(seqs, room)
        seen[-1].update(room=list(room), ks=ks)
        return ks

    draft.propose, planner.plan = recording_propose, recording_plan
    prompts = twenty_prompts()[:4]  # two quote themselves, two do not
    assert [d.token_ids for d in llm.generate(prompts, GREEDY)] == outputs(LLM(str(tiny_llama), **SMALL), prompts)[0]
    assert seen and all(step["room"] == step["found"] for step in seen)
    assert all(k <= found for step in seen for k, found in zip(step["ks"], step["found"]))
    assert any(0 in step["found"] for step in seen) and any(any(step["found"]) for step in seen)


def test_the_server_reports_speculation_in_usage_and_answers_as_without_it(tiny_llama):
    from test_server import client, running_server

    prompt = twenty_prompts()[5]
    plain = LLM(str(tiny_llama)).generate([prompt], GREEDY)[0]
    with running_server(LLM(str(tiny_llama), speculative="ngram")) as (url, _):
        reply = client(url).completions.create(
            model="llama", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
    assert reply.choices[0].text == plain.text
    usage = reply.usage.model_extra["surgeon"]["speculation"]
    assert usage["proposed"] >= usage["accepted"] > 0 and usage["tokens_per_target_step"] > 1.0


def test_a_request_may_decline_speculation(tiny_llama):
    llm = LLM(str(tiny_llama), speculative="ngram", **SMALL)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, loop_window=0, speculate=False)
    done = llm.generate(twenty_prompts()[1::2][:3], params)
    assert all(d.speculation["proposed"] == 0 for d in done)
    assert [d.token_ids for d in done] == outputs(llm, twenty_prompts()[1::2][:3])[0]


def test_a_reduced_vocabulary_draft_proposes_only_its_tokens_and_changes_nothing(tiny_llama, tmp_path):
    """A draft whose config names a reduced output vocabulary (what the draft_vocabulary step
    writes): the engine scores only those rows; proposals stay inside them; output is unchanged."""
    import json

    draft = first_layers(tiny_llama, tmp_path / "draft", keep=5)
    kept = list(range(2, 160))  # EOS (2) and half the vocabulary
    config = json.loads((draft / "config.json").read_text())
    config["surgeon_draft"] = {"draft_for": "tiny llama", "token_ids": kept}
    (draft / "config.json").write_text(json.dumps(config))
    spec = {"method": "model", "draft": str(draft), "k": 3, "adaptive": False}
    llm = LLM(str(tiny_llama), speculative=spec, **SMALL)
    assert llm.speculator.draft.engine.model.lm_head.weight.shape[0] == len(kept)
    proposed = []
    original = llm.speculator.draft.propose

    def spy(seqs, ks):
        out = original(seqs, ks)
        proposed.extend(t for p in out for t in p.tokens)
        return out

    llm.speculator.draft.propose = spy
    batch = twenty_prompts()[:8]
    assert outputs(llm, batch)[0] == outputs(LLM(str(tiny_llama), **SMALL), batch)[0]
    assert proposed and set(proposed) <= set(kept)
    # Sampling too: the draft's distribution is zero outside its tokens, and the rule stays exact.
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, loop_window=0, seed=3)
    assert all(len(d.token_ids) == 12 for d in llm.generate(batch, params))


def test_warm_up_compiles_every_decode_shape_before_the_first_request(tiny_llama, draft_llama):
    """After `warm_up`, speculative requests meet no shape that is not compiled yet (a draft's
    two-token catch-up once compiled for 13.7 s in the middle of an answer), the cache is as it
    was, and the answers are the plain engine's."""
    from torch._dynamo.utils import counters

    spec = {"method": "model", "draft": str(draft_llama), "k": 2, "adaptive": False}
    llm = LLM(str(tiny_llama), speculative=spec, compile=True, **SMALL)
    free = llm.blocks.num_free, llm.speculator.draft.engine.blocks.num_free
    assert llm.warm_up(batch_sizes=(1, 2)) > 0
    assert (llm.blocks.num_free, llm.speculator.draft.engine.blocks.num_free) == free
    graphs = counters["stats"]["unique_graphs"]
    batch = twenty_prompts()[:3]
    got, _ = outputs(llm, [batch[0]])
    got += outputs(llm, batch[1:])[0]
    assert counters["stats"]["unique_graphs"] == graphs
    assert got == outputs(LLM(str(tiny_llama), **SMALL), batch)[0]
    assert LLM(str(tiny_llama), **SMALL).warm_up() == 0.0  # nothing compiled: nothing to do


@pytest.mark.parametrize("kind", ["gqa", "mqa"])
def test_compiled_steps_give_a_row_the_same_logits_whatever_the_steps_width(kind, request):
    """With `batch_invariant=True`, a verification's logits are bit for bit those of one-token steps,
    and a sequence's step gives it the same logits beside another sequence as alone: so greedy
    speculation cannot flip a near-tie (plain `compile=True`: 1 of 8 real answers departed)."""
    from surgeon.engine.scheduler import Scheduled
    from surgeon.engine.sequence import Sequence

    target = request.getfixturevalue({"gqa": "tiny_llama", "mqa": "mqa_llama"}[kind])
    llm = LLM(str(target), compile=True, batch_invariant=True, **SMALL)
    runner, blocks = llm.runner, llm.blocks
    ids, other_ids = twenty_prompts()[11][:33], twenty_prompts()[12][:40]
    prompt, end = 21, 31  # keys cross block and vector-width boundaries on the way
    seq, other = Sequence(list(ids), SamplingParams()), Sequence(list(other_ids), SamplingParams())
    for s in (seq, other):
        blocks.allocate(s, reuse=False)
        s.token_ids = s.token_ids[:prompt]
        runner.run(Scheduled(True, [s], [prompt]))

    def step(s, position, width=1):
        s.token_ids, s.computed = (ids if s is seq else other_ids)[: position + width], position
        return Scheduled(False, [s], [width], verify=width > 1)

    alone = torch.stack([runner.run(step(seq, p))[0] for p in range(prompt, end)])
    for width in (2, 5):
        rows = [runner.run(step(seq, p, min(width, end - p))) for p in range(prompt, end, width)]
        assert torch.equal(torch.cat(rows), alone), f"verification of {width} rows"
    beside = []
    for p in range(prompt, end):
        a, b = step(seq, p), step(other, p)
        beside.append(runner.run(Scheduled(False, a.seqs + b.seqs, [1, 1]))[0])
    assert torch.equal(torch.stack(beside), alone)
    assert not torch.equal(alone[0], alone[1])  # the steps did read different positions


def test_batch_invariance_is_refused_where_it_cannot_hold(tiny_llama, sparse_llama):
    for settings in ({}, {"compile": True, "quantize": "int8"}):
        with pytest.raises(ValueError, match="batch_invariant=True needs compile=True on a CPU"):
            LLM(str(tiny_llama), batch_invariant=True, **settings)
    with pytest.raises(ValueError, match="sparse"):
        LLM(str(sparse_llama), batch_invariant=True, compile=True)
