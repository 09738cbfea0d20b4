"""The shape of the house: the method at the top level, infra/ and launch/ below, imports running one way
(docs/design.md, "The house"). Every project file is read with `ast`, lazy imports inside functions included, so
a rule cannot erode one import at a time."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("infra", "launch")
COPYABLE = ("attention", "grpo", "tri_model", "engine", "infra.compiled_step")  # each imports nothing of the project
SCRIPTS = ("trainer", "bench", "plot")  # the top-level files that are not the method's: entry point and scripts


def module_name(path: Path) -> str:
    """infra/tasks.py -> 'infra.tasks'; infra/__init__.py -> 'infra'; grpo.py -> 'grpo'."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {module_name(path): path for path in
         [*ROOT.glob("*.py"), *(path for package in PACKAGES for path in (ROOT / package).glob("*.py"))]}


def imported(name: str, tree: ast.Module) -> list[tuple[str, int]]:
    """(project module, line) for every import in the tree, at any depth: `import infra.tasks` -> infra.tasks,
    `from infra import outputs` -> infra.outputs (the package when the name is not a submodule), `from . import x`
    resolved from the importing module's package. Imports of anything outside the project are left out."""
    package = name if FILES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from . import x` in infra/a.py: level 1 is infra, level 2 its parent
                parts = package.split(".") if package else []
                anchor = parts[:len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = [".".join(filter(None, (base, alias.name))) for alias in node.names]
            targets = [submodule if submodule in FILES else base for submodule in submodules]
        else:
            continue
        for target in targets:
            while target and target not in FILES:  # the project module on the dotted path, if any (torch.nn: none)
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node.lineno))
    return found


IMPORTS = {name: imported(name, ast.parse(path.read_text(), str(path))) for name, path in FILES.items()}


def violations(importers, allowed) -> list[str]:
    """'file:line imports module' for each import by a module in `importers` that `allowed(target)` refuses."""
    return [f"{FILES[name].relative_to(ROOT)}:{line} imports {target}"
            for name in sorted(importers) for target, line in IMPORTS[name] if not allowed(target)]


def top_level(module: str) -> bool:
    """A module at the top level, not in infra/ or launch/."""
    return module.partition(".")[0] not in PACKAGES


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of a directed graph (iterative: no recursion limit)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def a_cycle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One cycle through a strongly connected component, as a path a -> b -> ... -> a (breadth-first: a short one)."""
    start, inside = members[0], set(members)
    paths, frontier = {}, [[start]]
    while start not in paths:
        next_frontier = []
        for path in frontier:
            for child in sorted(graph[path[-1]] & inside):
                if child not in paths:
                    paths[child] = path + [child]
                    next_frontier.append(paths[child])
        frontier = next_frontier
    return paths[start]


def test_the_files_are_where_the_rules_expect_them():
    """Claim: the rules below read the real tree: the method files, infra/ and launch/ are found and their imports
    parsed (an empty walk would pass every rule)."""
    assert {"periodic_rl", "config", "grpo", "infra.reward", "launch.setup"} <= set(IMPORTS)
    assert {"infra.reward", "infra.models", "rollout"} <= {target for target, _ in IMPORTS["inference"]}  # lazy too


def test_no_import_cycle():
    """Claim: no import cycle among the project's modules, lazy imports inside functions included (a lazy import
    that closes a loop is a loop: the definition belongs elsewhere)."""
    graph = {name: {target for target, _ in targets} for name, targets in IMPORTS.items()}
    cycles = [" -> ".join(a_cycle(graph, members)) for members in strongly_connected(graph) if len(members) > 1]
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_infra_imports_only_config_from_above():
    """Claim: infra/ imports nothing from the top level but config.py, and nothing from launch/: the machinery
    never reaches up into the method or the launcher."""
    infra = [name for name in IMPORTS if name.partition(".")[0] == "infra"]
    problems = violations(infra, lambda target: target == "config" or target.partition(".")[0] == "infra")
    assert not problems, problems


@pytest.mark.parametrize("name", [*COPYABLE, "config"])
def test_copyable_files_and_config_import_nothing_of_the_project(name):
    """Claim: attention.py, grpo.py, tri_model.py, engine.py and infra/compiled_step.py (engine.py's compiled step)
    can be copied alone, and config.py (the dataclass everything reads) stands on nothing: none imports any project
    module."""
    if name not in IMPORTS:
        pytest.skip(f"{name}.py does not exist yet")
    problems = violations([name], lambda target: False)
    assert not problems, problems


def test_method_files_import_nothing_from_launch():
    """Claim: the top-level method files (all but trainer.py, bench.py and plot.py) import nothing from launch/:
    launch builds on the method, not the other way round."""
    method = [name for name in IMPORTS if top_level(name) and name not in SCRIPTS]
    problems = violations(method, lambda target: target.partition(".")[0] != "launch")
    assert not problems, problems


def test_the_schedule_and_the_top_level_stay_small():
    """Claim: periodic_rl.py, the schedule that reads like the paper's figure, is at most 200 lines, every other
    top-level file (the core a reader opens) at most 500, and the top level holds at most 15 .py files (about a
    dozen method files, bench.py and plot.py)."""
    lines = len((ROOT / "periodic_rl.py").read_text().splitlines())
    assert lines <= 200, f"periodic_rl.py has {lines} lines"
    top = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(top) <= 15, f"{len(top)} .py files at the top level: {top}"
    long = {name: n for name in top if (n := len((ROOT / name).read_text().splitlines())) > 500}
    assert not long, f"core files over 500 lines: {long}"


EXAMPLES = sorted(name for name, path in {**FILES, **{module_name(path): path for folder in ("benchmarks", "tools")
                                                       for path in (ROOT / folder).glob("*.py")}}.items()
                  if ">>> " in path.read_text())


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_docstrings_examples_hold(name):
    """Claim: every example in a docstring (`>>> ...`) still gives what it shows, so the usage a reader copies
    from a function's docstring is checked like the rest (doctest, on the module as imported)."""
    import doctest
    import importlib
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result.failed} of {result.attempted} failed"
