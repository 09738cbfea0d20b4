"""Old module names, for reward files written before the re-layout: `from tasks import extract_final_number` or
`import reward` still work, and say once on stderr where the module went.

`install()` appends a finder to sys.meta_path (after the path finders: a user's own `tasks.py` still wins). Importing
an old name imports the new module and binds it under both names: sys.modules['tasks'] is sys.modules['infra.tasks'].
infra/reward.py installs it right before it imports a user's reward module or file. The new modules are imported
only when an old name is, so infra/ still imports nothing from the top level or launch/ when it loads.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    **{name: f"infra.{name}" for name in ("checkpoint", "outputs", "tracking", "timeline", "liveness", "distributed",
                                          "tasks", "data", "models", "reward", "math_verify_reward")},
    "run_config": "infra.records",
    "sizing": "launch.sizing",
    "remote": "launch.remote",
    "worker": "inference",
}  # old name -> where it lives now


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name; loads it as the module it moved to, saying so once per old name."""

    def __init__(self):
        self.told: set[str] = set()  # the old names already reported on stderr

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        if spec.name not in self.told:
            self.told.add(spec.name)
            print(f"periodic-rl: module '{spec.name}' moved to '{new}'; import it from there", file=sys.stderr,
                  flush=True)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import machinery sets __spec__ to the old name's: undone below
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # already executed under its new name


def install() -> None:
    """Let the old names be imported (idempotent)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
