"""`LLM`: the engine's front door (cf. nano-vllm's LLMEngine).

    llm = LLM("out/smollm2-drop6")
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32))

Requests are added, then `step()` runs one scheduled batch and returns what each request gained.
`generate` and `stream` are loops over that; the server drives it from one background thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .loader import Loaded, from_memory, load
from .quantize import quantize_weights
from .runner import ModelRunner
from .sampler import sample
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import SpeculativeConfig, Speculator
from .stopping import Stopper

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    request_id: str
    text: str  # new text since this request's previous output
    token_ids: list[int]  # new token ids
    finish_reason: str | None  # None while running; "stop", "length" or "loop" (degenerate repetition)
    prompt_tokens: int
    completion_tokens: int
    speculation: dict | None = None  # on the last output when speculating: proposed, accepted, target steps


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    speculation: dict | None = None  # proposed / accepted draft tokens, target steps (speculative engines)


def _text_only(message: dict) -> dict:
    """A message whose content is text parts (as OpenAI clients often send it) as one string."""
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
            raise ValueError("a text-only model takes text content parts only")
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise ValueError("a message's content is a string or a list of text parts")
    return {**message, "content": content}


class LLM:
    """`path`: a surgeon export, a Hugging Face folder of a supported family, or a surgeon alias.
    `quantize="int8"|"int4"`: int8 (per channel) or int4 (groups of 32) weights on a CPU, rounded
    to nearest here (faster decoding, outputs close to but not identical to the full-precision
    model's). A quantize step's export (compressed-tensors) runs on its own integers and scales by
    default on a CPU; `quantize="none"` runs its dequantized weights in float instead.
    `compile=True`: decode steps through torch.compile; on a CPU the weights are frozen into the
    graph and read by inductor's packed GEMM (compiled.py: a second, packed copy of the weights, and
    the model must not change afterwards; each new step shape compiles once, a few minutes on 2
    cores; `warm_up()` compiles them before the first request). `kv_cache_tokens`: positions the
    paged cache holds over all sequences (default: 1 GiB worth on a CPU, 60% of free memory on a
    GPU).
    `batch_invariant=True` (with `compile=True` on a CPU, float weights, dense attention): a decode
    step computes each row bit for bit alike whatever the rows beside it, so a request's tokens do
    not depend on its batch and greedy speculation gives exactly the tokens it gives without
    (compiled.py); it costs a verification more attention time (+11 ms a verification at 448 keys,
    SmolLM2-135M).
    `max_batched_tokens`: the prefill chunk budget per step. `speculative`: decode speculatively
    (the output distribution is unchanged; greedy output is the same tokens, up to float rounding
    unless `batch_invariant`): "ngram", a draft checkpoint's path, or a dict such as
    {"method": "model", "draft": PATH, "k": 4} (see speculative.SpeculativeConfig)."""

    def __init__(
        self,
        path: str | Loaded,
        *,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        max_num_seqs: int = 16,
        max_batched_tokens: int = 512,
        block_size: int = 16,
        kv_cache_tokens: int | None = None,
        prefix_caching: bool = True,
        quantize: str | None = None,
        compile: bool = False,
        batch_invariant: bool = False,
        trust_remote_code: bool = False,
        speculative: dict | str | SpeculativeConfig | None = None,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        loaded = path if isinstance(path, Loaded) else load(str(path), self.device, self.dtype, trust_remote_code)
        self.model, self.tokenizer, self.vision = loaded.model, loaded.tokenizer, loaded.vision
        self.model_name = loaded.name
        if quantize not in (None, "none", "int8", "int4"):
            raise ValueError(f"quantize must be None, 'none', 'int8' or 'int4', got {quantize!r}")
        exported = loaded.exported_quantization
        if quantize is None and exported and self.device.type == "cpu":
            quantize = f"int{exported['bits']}"
        self.quantized = quantize if quantize in ("int8", "int4") else None
        if self.quantized:
            if self.device.type != "cpu":
                raise ValueError(f"quantize={quantize!r} is a CPU decoding path; on a GPU use dtype='bfloat16'")
            bits = int(self.quantized[3:])
            scales = exported["scales"] if exported and exported["bits"] == bits else None
            quantize_weights(self.model, bits, exported=scales)
        if batch_invariant and not (compile and self.device.type == "cpu" and not self.quantized):
            raise ValueError(
                "batch_invariant=True needs compile=True on a CPU with float weights (eager steps and "
                "the int8/int4 kernels round a row differently by how many rows a step has)"
            )
        if batch_invariant and any(layer.attention.indexer is not None for layer in self.model.layers):
            # its indexer scores and top-k attention are einsums whose rounding follows the step's
            # width (a 5-row verification departed from one-token steps in the test)
            raise ValueError("batch_invariant=True is for dense attention; this model has sparse (DSA) layers")
        per_token = ModelRunner.cache_bytes_per_token(self.model, self.dtype)
        if kv_cache_tokens is None:
            kv_cache_tokens = self._default_cache_tokens(per_token)
        num_blocks = max(2, kv_cache_tokens // block_size)
        self.max_model_len = min(num_blocks * block_size, self.model.config.max_position_embeddings)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_batched_tokens)
        self.runner = ModelRunner(
            self.model,
            self.vision,
            num_blocks,
            block_size,
            self.device,
            self.dtype,
            compile,
            bool(self.quantized),
            batch_invariant,
        )
        self.stopper = Stopper(self.tokenizer, loaded.eos_ids, self.max_model_len)
        self.requests: dict[str, Sequence] = {}
        self.speculator = self._speculator(SpeculativeConfig.parse(speculative), max_num_seqs, kv_cache_tokens)
        log.info(
            "engine: %s on %s (%s), KV cache %d tokens in blocks of %d",
            self.model_name,
            self.device,
            str(self.dtype).removeprefix("torch."),
            num_blocks * block_size,
            block_size,
        )

    @classmethod
    def from_model(cls, model, tokenizer, *, dtype: str | torch.dtype | None = None, **engine_args) -> LLM:
        """An engine over a text model already in memory (a recipe's patient or parent), without a
        round trip through disk. Weights are shared when `dtype` is the model's; otherwise the
        engine runs on a converted copy and the caller's model is left as it was."""
        device = torch.device(engine_args.pop("device", None) or next(model.parameters()).device)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or next(model.parameters()).dtype)
        loaded = from_memory(model, tokenizer, device, dtype)
        return cls(loaded, device=str(device), dtype=dtype, **engine_args)

    def _speculator(self, config: SpeculativeConfig | None, max_num_seqs: int, cache_tokens: int):
        from .drafts import ModelDraft, NgramDraft

        if config is None:
            return None
        if config.method == "ngram":
            draft = NgramDraft(config, {self.vision.image_token_id} if self.is_vlm else set())
        else:
            draft = ModelDraft(
                config,
                self,
                device=str(self.device),
                dtype=self.dtype,
                max_num_seqs=max_num_seqs,
                kv_cache_tokens=cache_tokens,
                prefix_caching=False,
                compile=self.runner.compiled,  # a draft's rounds are decode steps: cheap only compiled alike
            )
        return Speculator(config, draft, self.runner, self.blocks, self.max_model_len, self.device)

    def warm_up(self, batch_sizes=(1, 2), widths=None) -> float:
        """With compile=True, compile before the first request the decode shapes requests will
        meet at each batch size: the plain step, and when speculating a verification of every
        width up to k + 1 in the target and the same widths in a model draft (its rounds and
        catch-ups). A shape first met inside a request compiles there, for seconds: measured, a
        draft's two-token catch-up took 13.7 s in the middle of an answer. Seconds taken (0
        without compile=True: nothing to compile)."""
        if not self.runner.compiled:
            return 0.0
        if widths is None:
            widths = range(1, self.speculator.config.k + 2) if self.speculator is not None else (1,)
        start = time.perf_counter()
        for rows in batch_sizes:
            self.runner.compile_shapes(self.blocks, rows, widths)
        draft_engine = getattr(self.speculator.draft, "engine", None) if self.speculator is not None else None
        if draft_engine is not None:
            draft_engine.warm_up(batch_sizes, widths)
        seconds = time.perf_counter() - start
        log.info("engine: decode shapes compiled in %.1f s", seconds)
        return seconds

    def _default_cache_tokens(self, per_token: int) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.6) // per_token
        return (1 << 30) // per_token

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def is_vlm(self) -> bool:
        return self.vision is not None

    # --- requests ------------------------------------------------------------------------------

    def encode(self, prompt, images: list | None = None) -> tuple[list[int], list]:
        """Token ids and image spans of a prompt: text, token ids, or chat messages."""
        images = list(images or [])
        if images and not self.is_vlm:
            raise ValueError(f"{self.model_name} is a text-only model; it cannot take images")
        spans = []
        if isinstance(prompt, str):
            if images:
                raise ValueError("images need chat messages with image parts, not a plain text prompt")
            ids = self.tokenizer(prompt)["input_ids"]
            if self.is_vlm and self.vision.image_token_id in ids:  # typed, so text: no image slot
                ids = self.vision.plain_ids(prompt)
        elif isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
            if images:
                raise ValueError("images need chat messages with image parts, not token ids")
            ids = list(prompt)
            vocab = self.model.config.vocab_size
            placeholder = self.vision.image_token_id if self.is_vlm else None  # may lie past the LM's vocabulary
            bad = next((token for token in ids if not 0 <= token < vocab and token != placeholder), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        elif isinstance(prompt, list) and all(isinstance(message, dict) for message in prompt):
            ids, spans = self._chat(prompt, images)
        else:
            raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages")
        if not ids:
            raise ValueError("the prompt is empty")
        if self.is_vlm and not spans and self.vision.image_token_id in ids:
            raise ValueError("the prompt holds image placeholder tokens but no images were given")
        return ids, spans

    def _chat(self, messages: list[dict], images: list) -> tuple[list[int], list]:
        from ..chat import chat_ids
        from ..errors import DataError

        if self.tokenizer.chat_template is None:
            raise ValueError(f"{self.model_name} has no chat template; send a plain text prompt")
        try:
            if self.is_vlm:
                return self.vision.encode(messages, images)
            return chat_ids(self.tokenizer, [_text_only(message) for message in messages], generation_prompt=True), []
        except DataError as exc:
            raise ValueError(str(exc)) from None

    def add_request(
        self, prompt, params: SamplingParams | None = None, images: list | None = None, request_id: str | None = None
    ) -> str:
        params = params or SamplingParams()
        ids, spans = self.encode(prompt, images)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this engine holds at most {self.max_model_len - 1} prompt tokens"
            )
        if (
            params.refuse_overflow
            and params.max_tokens is not None
            and len(ids) + params.max_tokens > self.max_model_len
        ):
            raise ValueError(
                f"max_tokens={params.max_tokens} does not fit: the prompt has {len(ids)} tokens and the context "
                f"holds {self.max_model_len}, so at most {self.max_model_len - len(ids)} new tokens"
            )
        seq = Sequence(ids, params, request_id=request_id or "", images=spans)
        if self.speculator is not None:
            seq.spec.start_from(self.speculator.prior)
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.finished:
            self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.speculator is not None:
            self.speculator.draft.forget(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # --- stepping ------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        if self.speculator is not None and not scheduled.prefill:
            seqs, gained = self.speculator.step(scheduled)
            return [self._emit(seq, tokens) for seq, tokens in zip(seqs, gained)]
        logits = self.runner.run(scheduled)
        done = [seq for seq, chunk in zip(scheduled.seqs, scheduled.chunks) if seq.computed + chunk == len(seq)]
        for seq, chunk in zip(scheduled.seqs, scheduled.chunks):
            seq.computed += chunk
            self.blocks.commit(seq)
        return [self._emit(seq, [token]) for seq, token in zip(done, sample(logits, done))]

    def _emit(self, seq: Sequence, tokens: list[int]) -> StepOutput:
        """Append a step's tokens one by one, each checked for a stop; what follows a stop is dropped."""
        texts, kept, reason = [], [], None
        for token in tokens:
            seq.token_ids.append(token)
            kept.append(token)
            text, reason = self.stopper.check(seq)
            texts.append(text)
            if reason is not None:
                break
        seq.spec.target_steps += 1
        if self.speculator is not None:
            # Keys past a stop are not this sequence's; blocks past its tokens were a rejected tail.
            seq.computed = min(seq.computed, len(seq) if reason is not None else len(seq) - 1)
            self.blocks.commit(seq)
            self.blocks.trim(seq)
        speculation = None
        if reason is not None:
            speculation = seq.spec.summary() if self.speculator is not None else None
            self._finish(seq, reason)
            self.requests.pop(seq.request_id, None)
        return StepOutput(
            seq.request_id, "".join(texts), kept, reason, seq.prompt_len, len(seq.completion_ids), speculation
        )

    def generate(
        self,
        prompts: list,
        params: SamplingParams | list[SamplingParams] | None = None,
        images: list[list] | None = None,
        progress: str | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion (batched continuously); results in the prompts' order.
        `progress`: a description for a progress bar over finished requests (none when None)."""
        from tqdm.auto import tqdm

        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        images = images or [None] * len(prompts)
        order = []
        try:
            for prompt, p, imgs in zip(prompts, params, images):
                order.append(self.add_request(prompt, p, imgs))
        except ValueError:
            for rid in order:  # all or nothing: no half of a batch left running
                self.abort(rid)
            raise
        results: dict[str, Completion] = {}
        gathered: dict[str, tuple[list[str], list[int]]] = {rid: ([], []) for rid in order}
        bar = tqdm(total=len(order), desc=progress, unit="answer", disable=progress is None, leave=False)
        while self.has_unfinished():
            for out in self.step():
                if out.request_id not in gathered:
                    continue
                texts, tokens = gathered[out.request_id]
                texts.append(out.text)
                tokens.extend(out.token_ids)
                if out.finish_reason is not None:
                    results[out.request_id] = Completion(
                        out.request_id, "".join(texts), tokens, out.finish_reason, out.prompt_tokens, out.speculation
                    )
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def stream(self, prompt, params: SamplingParams | None = None, images: list | None = None) -> Iterator[StepOutput]:
        """One request's outputs as they come (other requests in flight progress too)."""
        rid = self.add_request(prompt, params, images)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finish_reason is not None:
                            return
        finally:
            self.abort(rid)
