"""The contract between a recipe and its operations: what `plan` sees of the model between steps,
what every step is given (its sources, its checkpoint folder, the run's digest), and the registry
the operations in surgeon/ops/ add themselves to.

An operation has a pydantic `Params` model and two methods:
- `plan(params, state, ctx)`: check the parameters against the model they will meet and return the
  model's state afterwards. No weights are read; raise ParamError for anything that cannot work.
- `apply(params, patient, ctx)`: do it, returning a new Patient with a provenance entry.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel
from transformers import PretrainedConfig

from ..checkpoints.sources import Source
from ..errors import ParamError
from ..text import TextData, resolve_text_files, token_windows
from .patient import Patient

# Names a step may use for "the model as it stands now" and "the recipe's unoperated base".
PATIENT = "patient"
BASE = "base"


@dataclass(frozen=True)
class ModelState:
    """What `plan` knows of the model between steps: its config and working dtype."""

    config: PretrainedConfig
    dtype: torch.dtype


@dataclass
class StepContext:
    recipe_dir: Path
    sources: dict[str, Source]  # named sources, plus BASE
    index: int = 0
    label: str = ""  # "steps[3].evaluate", for messages
    previous_op: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # what plan learned, reused by apply
    work_dir: Path | None = None  # the run's checkpoints (beside the export); None in plan
    resume: bool = False
    recipe_digest: str = ""

    def resolve_text(self, key: str, data: TextData, path: tuple) -> list[Path]:
        """In plan: the files of a step's text (an error points at `path` in the recipe), kept under
        `key` for apply."""
        try:
            files = resolve_text_files(data, self.recipe_dir)
        except ParamError as exc:
            raise exc.under(path) from None
        self.facts[key] = files
        return files

    def text_windows(self, key: str, data: TextData, tokenizer) -> tuple[list[Path], torch.Tensor]:
        """In apply: the files plan kept under `key` (resolved now when apply runs unplanned) and
        their token windows."""
        files = self.facts.get(key) or resolve_text_files(data, self.recipe_dir)
        return files, token_windows(tokenizer, files, data)

    @contextmanager
    def checkpoint_dir(self, kind: str) -> Iterator[Path]:
        """This step's checkpoint folder for `kind` of training (heal, indexer), under the run's;
        outside a run (a library call), under a temporary folder removed afterwards."""
        if self.work_dir is not None:
            yield self.work_dir / f"{kind}-step{self.index}"
            return
        with tempfile.TemporaryDirectory(prefix="surgeon-step-") as tmp:
            yield Path(tmp) / f"{kind}-step{self.index}"

    def run_digest(self, *parts: object) -> str:
        """A key unique to this recipe, this step and what it trains on (`parts`): a resumed run
        trusts a checkpoint only under the same key, and a patient's fingerprint includes it."""
        key = "|".join([self.recipe_digest, str(self.index), *map(str, parts)])
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def stage_name(self, name: str | None) -> str:
        """A measuring step's label in the report: its own `name`, else after the last operation."""
        return name or (f"after {self.previous_op}" if self.previous_op else "base")


class Operation:
    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]]
    summary: ClassVar[str] = ""
    measures: ClassVar[bool] = False  # measures the model without changing it (stage names skip these)
    accepts_vlm: ClassVar[bool] = False  # may follow graft_vision (others edit the LM's layers directly)

    def plan(self, params: BaseModel, state: ModelState, ctx: StepContext) -> tuple[ModelState, str]:
        """Return the state after this step and a short note for the plan table."""
        raise NotImplementedError

    def apply(self, params: BaseModel, patient: Patient, ctx: StepContext) -> Patient:
        raise NotImplementedError


OPERATIONS: dict[str, Operation] = {}


def register(cls: type[Operation]) -> type[Operation]:
    if cls.name in OPERATIONS:
        raise RuntimeError(f"operation {cls.name!r} registered twice")
    OPERATIONS[cls.name] = cls()
    return cls
