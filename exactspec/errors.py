"""The one exception family. Every message names the file, tensor or field at fault.

    ExactSpecError                 the CLI prints it in one line and exits with code 2
      CheckpointError              a checkpoint file is missing, unreadable or inconsistent
        WeightError                a tensor is missing, or has the wrong shape or dtype
      UnsupportedModelError        an architecture, rope type, activation or dtype we do not run
      InvalidRequest               a request field is out of range (`.field` names it); HTTP 400
        ContextLengthError         the prompt plus the tokens asked for do not fit the context
      GenerationError              decoding failed inside the engine (not the caller's input); HTTP 500
        ConstraintError            the matcher could not follow a constraint past some output (its limits);
                                   the caller's constraint, `.field` names it; HTTP 400
"""


class ExactSpecError(Exception):
    """Base class: the CLI prints these in one line and exits with code 2."""


class CheckpointError(ExactSpecError):
    """A checkpoint folder or file is missing, unreadable or inconsistent."""


class UnsupportedModelError(ExactSpecError):
    """The architecture, rope type, activation or dtype is not supported."""


class WeightError(CheckpointError):
    """A tensor is missing, or has the wrong shape or dtype."""


class InvalidRequest(ExactSpecError, ValueError):
    """A request field (prompt, a sampling parameter, a drafter setting, a CLI flag) is out of
    range. `field` is its name as the Python API spells it (None when it is no single field)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ContextLengthError(InvalidRequest):
    """A prompt (plus the tokens to generate) does not fit the model's context."""


class GenerationError(ExactSpecError):
    """Decoding failed for a reason that is not the caller's input (an internal error). From
    `generate_batch`, `results` holds every sequence's GenerationResult (the failed ones with
    finish_reason "error"), so the others are not lost."""

    results: list | None = None


class ConstraintError(GenerationError):
    """A constraint that was accepted but that the matcher could not follow past some output (one of
    llguidance's resource limits, met only there): the caller's input, `field` names it."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


InvalidArgumentError = InvalidRequest  # the earlier name, kept for callers that catch it
