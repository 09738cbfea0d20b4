"""The one exception a user can fix: trainer.py turns it into one `error:` line and exit code 1."""


class UserError(RuntimeError):
    """A problem the user can fix (an option, a path, a model, the data, a reward function, a dead inference
    process): trainer.py reports it as one `error:` paragraph and exit code 1, no traceback."""
