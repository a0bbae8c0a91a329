"""User-facing errors. The CLI prints these as `error: ...` and exits 2, without a traceback."""

from __future__ import annotations


class SurgeonError(Exception):
    """A mistake the user can fix: the message says what is wrong and where."""


class RecipeError(SurgeonError):
    """One or more problems in a recipe file, each located at `file:line: path: message`."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class SourceError(SurgeonError):
    """A source (alias, folder, .gguf file) that cannot be resolved or loaded."""


class DataError(SurgeonError):
    """Calibration or evaluation data that is missing or too small."""


class RunCancelled(SurgeonError):
    """The run was stopped on request (the studio's Stop); nothing was exported."""


class ExportError(SurgeonError):
    """An export or upload that cannot be done; nothing was written."""


class ParamError(SurgeonError):
    """A step parameter that cannot work with the model it will meet.

    `path` is relative to the step's parameters (e.g. ("layers",)); `node` optionally points deeper
    (e.g. ("layers", 3)) so the reported line is the offending item's, while the printed path stays
    at the field.
    """

    def __init__(self, path: tuple, message: str, node: tuple | None = None):
        self.path = tuple(path)
        self.node = tuple(node) if node is not None else self.path
        self.message = message
        super().__init__(message)

    def under(self, prefix: tuple) -> ParamError:
        """The same error seen from a parent field (e.g. ("calibration",) + ("text",))."""
        return ParamError(tuple(prefix) + self.path, self.message, node=tuple(prefix) + self.node)
