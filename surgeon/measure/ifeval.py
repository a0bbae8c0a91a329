"""IFEval (Zhou et al. 2023, "Instruction-Following Evaluation for Large Language Models",
arXiv 2311.07911; data CC BY 4.0): 541 prompts with verifiable instructions ("no commas", "at
least 300 words", "wrap the answer in JSON"), answered greedily through the chat template and
scored by `if-verifiable`'s copy of Google's instruction checks, not by a rewrite of them.

Scores: prompt-level (every instruction of a prompt followed) and instruction-level, each strict
(the answer as written) and loose (also after dropping a first/last line or markdown asterisks).
`ifeval` is the leaderboard's headline: the mean of prompt- and instruction-level strict.

Offline substitute: two checks use nltk's Punkt models, which nltk downloads on first use. When
they are not installed, `length_constraints:number_sentences` counts sentences with an untrained
Punkt tokenizer given common English abbreviations, and `change_case:capital_word_frequency` splits
words with the Treebank tokenizer alone (no sentence split first, which changes no upper-case
count). The result records which was used.

Reproducible scores: Google's `keywords:letter_frequency` check draws a random letter when the
data's letter is not a-z (IFEval asks for '#' and '!' in a few prompts), and its other checks draw
defaults the same way; each prompt is scored under Python's `random` seeded with its key (the
caller's random state restored), so an answer scores the same in every run and process.
"""

from __future__ import annotations

import json
import logging
import random
import types
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError

log = logging.getLogger(__name__)

HUB_DATASET = "google/IFEval"
ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "u.s", "no", "fig"}


@dataclass(frozen=True)
class IfevalPrompt:
    key: int
    prompt: str
    instruction_ids: tuple[str, ...]
    kwargs: tuple[dict, ...]


def load_prompts(path: Path | None = None, limit: int | None = None) -> list[IfevalPrompt]:
    """IFEval's prompts from a jsonl file (its `input_data.jsonl`), or from the Hub's google/IFEval
    through `datasets` when no file is named. `limit`: the first N (the file's order)."""
    if path is None:
        import datasets

        rows = datasets.load_dataset(HUB_DATASET, split="train")
    else:
        if not path.is_file():
            raise DataError(f"no IFEval file at {path}")
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = []
    for number, row in enumerate(rows, start=1):
        try:
            prompts.append(
                IfevalPrompt(int(row["key"]), row["prompt"], tuple(row["instruction_id_list"]), tuple(row["kwargs"]))
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{path or HUB_DATASET}:{number}: not an IFEval record ({exc})") from None
    return prompts[:limit] if limit else prompts


def score(prompts: list[IfevalPrompt], responses: list[str]) -> dict:
    """Prompt- and instruction-level accuracy, strict and loose, plus per-prompt results."""
    from if_verifiable.common import evaluate_instructions

    registry, punkt = _registry()
    per_prompt = []
    outside = random.getstate()
    try:
        for item, response in zip(prompts, responses, strict=True):
            random.seed(item.key)  # what a check draws for itself is the same in every run
            results, _ = evaluate_instructions(
                response=response,
                instruction_id_list=list(item.instruction_ids),
                kwargs_list=[dict(k) for k in item.kwargs],
                prompt=item.prompt,
                instruction_registry=registry,
            )
            per_prompt.append(_passes(item, response, results))
    finally:
        random.setstate(outside)
    instructions = sum(len(p["strict"]) for p in per_prompt)
    metrics = {
        "prompt_strict": sum(all(p["strict"]) for p in per_prompt) / len(per_prompt),
        "prompt_loose": sum(all(p["loose"]) for p in per_prompt) / len(per_prompt),
        "inst_strict": sum(sum(p["strict"]) for p in per_prompt) / instructions,
        "inst_loose": sum(sum(p["loose"]) for p in per_prompt) / instructions,
        "prompts": len(per_prompt),
        "instructions": instructions,
    }
    metrics["ifeval"] = (metrics["prompt_strict"] + metrics["inst_strict"]) / 2
    metrics["ifeval_loose"] = (metrics["prompt_loose"] + metrics["inst_loose"]) / 2
    return {"metrics": metrics, "punkt": punkt, "per_prompt": per_prompt}


def _passes(item: IfevalPrompt, response: str, results) -> dict:
    # An empty answer follows nothing: if-verifiable returns no results for it, which would drop
    # its instructions from the instruction-level denominator.
    strict = [r.strict_pass for r in results] or [False] * len(item.instruction_ids)
    loose = [r.loose_pass for r in results] or [False] * len(item.instruction_ids)
    return {"key": item.key, "strict": strict, "loose": loose, "response": response}


def _registry() -> tuple[dict, str]:
    """The instruction registry, with the offline Punkt substitute installed when nltk's data is
    missing; and which sentence splitter is in use."""
    import langdetect
    import nltk
    from if_verifiable.ifeval import instructions_util

    # language:response_language asks langdetect, which samples: unseeded, one answer scores
    # differently from run to run.
    langdetect.DetectorFactory.seed = 0
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        return INSTRUCTION_DICT, "nltk punkt"
    except LookupError:
        pass
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    parameters = PunktParameters()
    parameters.abbrev_types = set(ABBREVIATIONS)
    splitter = PunktSentenceTokenizer(parameters)
    instructions_util._get_sentence_tokenizer = lambda: splitter
    # instructions.py calls instructions_util.nltk.word_tokenize: give that module an nltk whose
    # word_tokenize skips the sentence split (the only part that needs the missing data).
    instructions_util.nltk = types.SimpleNamespace(
        tokenize=nltk.tokenize,
        data=nltk.data,
        word_tokenize=lambda text, language="english": nltk.word_tokenize(text, language, preserve_line=True),
    )
    return INSTRUCTION_DICT, "untrained punkt + common abbreviations (nltk punkt data not installed)"


def chat(prompt: IfevalPrompt) -> list[dict]:
    return [{"role": "user", "content": prompt.prompt}]


def run_ifeval(
    model, tokenizer, fingerprint: str, prompts: list[IfevalPrompt], max_tokens: int = 512, dtype: str = "float32"
) -> dict:
    """Generate (greedy, through the engine; cached per model and settings) and score."""
    from ..answers import AnswerSettings, answer

    settings = AnswerSettings(max_new_tokens=max_tokens, dtype=dtype)
    answered = answer(model, tokenizer, [chat(p) for p in prompts], settings, fingerprint)
    result = score(prompts, [c[-1]["content"] for c in answered.chats])
    result["generation"] = {"seconds": answered.seconds, "tokens": answered.tokens, "cached": answered.cached}
    return result


def ifeval_checkpoint(spec: str, data: Path | None, limit: int | None, max_tokens: int, dtype: str = "float32") -> dict:
    """`surgeon ifeval`: a checkpoint (alias, folder, GGUF) answered and scored."""
    from ..checkpoints.sources import resolve_source

    source = resolve_source(spec, Path.cwd())
    model = source.load_model().eval()
    result = run_ifeval(
        model, source.load_tokenizer(), source.fingerprint(), load_prompts(data, limit), max_tokens, dtype
    )
    result["settings"] = {"data": str(data or HUB_DATASET), "limit": limit, "max_tokens": max_tokens, "dtype": dtype}
    return result


def ifeval_line(name: str, m: dict) -> str:
    return (
        f"{name}: IFEval {m['ifeval']:.3f} (prompt strict {m['prompt_strict']:.3f}, instruction strict "
        f"{m['inst_strict']:.3f}; loose {m['prompt_loose']:.3f} / {m['inst_loose']:.3f}) over {m['prompts']} prompts"
    )
