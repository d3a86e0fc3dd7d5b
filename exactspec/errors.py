"""Exception classes. Every message names the file, tensor or parameter at fault."""


class ExactSpecError(Exception):
    """Base class: the CLI prints these in one line and exits with code 2."""


class CheckpointError(ExactSpecError):
    """A checkpoint folder or file is missing, unreadable or inconsistent."""


class UnsupportedModelError(ExactSpecError):
    """The architecture, rope type, activation or dtype is not supported."""


class WeightError(CheckpointError):
    """A tensor is missing, or has the wrong shape or dtype."""


class ContextLengthError(ExactSpecError):
    """A prompt (plus the tokens to generate) does not fit the model's context."""


class InvalidArgumentError(ExactSpecError, ValueError):
    """A generation parameter is out of range."""
