"""The entry point reads as the loop: from `trainer.main` a reader reaches `periodic_rl.train` in a few calls, and
`--help` shows the method's options first. Calls are read with `ast` (the names called in each function's body,
resolved through the module's imports), so the chain is the code's, not a list kept by hand."""
import ast
import re
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = {".".join(path.relative_to(ROOT).with_suffix("").parts): path
         for path in [*ROOT.glob("*.py"), *ROOT.glob("infra/*.py"), *ROOT.glob("launch/*.py")]}


def names_in(module: str) -> tuple[dict[str, ast.FunctionDef], dict[str, tuple[str, str | None]]]:
    """(the module's top-level functions by name, what each imported name stands for): `import periodic_rl` ->
    ('periodic_rl', None), `from launch import setup` -> ('launch.setup', None), `from launch.start import prepare`
    -> ('launch.start', 'prepare'). Imports at any depth count (a lazy import inside a function too)."""
    tree = ast.parse(FILES[module].read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update({(a.asname or a.name): (a.name, None) for a in node.names if a.name in FILES})
        elif isinstance(node, ast.ImportFrom) and not node.level:
            for a in node.names:
                whole = f"{node.module}.{a.name}"
                if whole in FILES:
                    imported[a.asname or a.name] = (whole, None)
                elif node.module in FILES:
                    imported[a.asname or a.name] = (node.module, a.name)
    return functions, imported


def calls(module: str, function: str) -> set[tuple[str, str]]:
    """The project functions `module.function` calls in its body, as (module, function): `f(...)` of a function
    defined or imported there, `m.f(...)` of an imported project module `m` (a `with f(...)` is a call too)."""
    functions, imported = names_in(module)
    found = set()
    for node in ast.walk(functions[function]):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name):
            if node.func.id in functions:
                found.add((module, node.func.id))
            elif imported.get(node.func.id, (None, None))[1]:
                found.add(imported[node.func.id])
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            target, name = imported.get(node.func.value.id, (None, "not a module"))
            if name is None:
                found.add((target, node.func.attr))
    return found


def call_depth(start: tuple[str, str], goal: tuple[str, str]) -> list[tuple[str, str]] | None:
    """The shortest chain of calls from `start` to `goal` (breadth first), or None when there is none."""
    came_from, queue = {start: None}, deque([start])
    while queue:
        here = queue.popleft()
        if here == goal:
            chain = []
            while here is not None:
                chain.append(here)
                here = came_from[here]
            return chain[::-1]
        module, function = here
        if function not in names_in(module)[0]:
            continue  # a class, or a name the module re-exports
        for callee in sorted(calls(module, function)):
            if callee not in came_from and callee[0] in FILES:
                came_from[callee] = here
                queue.append(callee)
    return None


def test_main_reaches_the_loop_in_at_most_three_calls():
    """Claim: `periodic_rl.train`, the loop, is at most three calls from `trainer.main` (main -> run -> started ->
    periodic_rl.train), so the entry point reads as the loop rather than as a maze of set-up; the walk finds real
    calls (main reaches the options' reader in one)."""
    assert call_depth(("trainer", "main"), ("launch.start", "options")) == [("trainer", "main"),
                                                                            ("launch.start", "options")]
    chain = call_depth(("trainer", "main"), ("periodic_rl", "train"))
    assert chain is not None, "trainer.main never reaches periodic_rl.train"
    assert len(chain) - 1 <= 3, " -> ".join(".".join(step) for step in chain)


def test_the_methods_knobs_come_first_in_the_config_and_in_help():
    """Claim: the method's knobs (config.CORE_FIELDS) are at most 25, each with a help line, and stand apart from
    the rest: they are Config's first fields, and --help's first group lists exactly their options, before TRL's
    extras, data, run management and scale."""
    import dataclasses

    from config import CORE_FIELDS, Config
    from infra.options import build_parser
    assert len(CORE_FIELDS) <= 25 and len(set(CORE_FIELDS)) == len(CORE_FIELDS)
    fields = dataclasses.fields(Config)
    assert tuple(f.name for f in fields[:len(CORE_FIELDS)]) == CORE_FIELDS
    assert all(f.metadata["help"] for f in fields[:len(CORE_FIELDS)])
    first = build_parser()._action_groups[2]  # argparse's positionals and options, then ours in order
    assert first.title == "the method"
    shown = [action.option_strings[0] for action in first._group_actions if action.help != "==SUPPRESS=="]
    assert shown == ["--" + name.replace("_", "-") for name in CORE_FIELDS]
    help_text = build_parser().format_help()
    later = min(help_text.index(f"\n{title}:") for title in ("model and data", "the run", "scale"))
    for name in CORE_FIELDS:  # each option's line of help: `  --lr LR ...`, `  --shared-prompt, --no-...`
        assert re.search(rf"\n  --{name.replace('_', '-')}[ ,\n]", help_text).start() < later, name


def test_importing_the_entry_point_loads_no_torch():
    """Claim: `import trainer` loads neither torch nor numpy: torch loads inside `main`, once the stop signals are
    caught and OpenMP's spin count is set (launch/start.options), so a Ctrl-C during start-up is one line, and the
    setting reaches the OpenMP runtime torch brings."""
    import subprocess
    import sys
    code = "import sys, trainer; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
