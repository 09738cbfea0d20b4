"""The exceptions a user can fix: trainer.py turns them into one `error:` line and exit code 1."""


class UserError(RuntimeError):
    """A problem the user can fix (an option, a path, a model, the data, a reward function, a dead inference
    process): trainer.py reports it as one `error:` paragraph and exit code 1, no traceback."""


class PipelineError(UserError):
    """The pipeline broke: an inference worker failed, died or froze (the message names it and why), a group reached
    the wrong trainer rank, an optimizer step went missing, or an iteration's metrics are not finite."""
