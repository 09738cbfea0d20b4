"""infra/reward.py: a reward named by --reward is loaded, or its problem is one line naming the file, module or
function."""
import importlib
import os
import sys

import pytest

from infra import reward, tasks
from infra.reward import RewardError


def test_load_reward_builtin_module_and_file(tmp_path, monkeypatch):
    """Claim: 'math' and 'math-verify' are the built-in rewards; 'module:function' imports a module;
    'file.py:function' loads a file."""
    from infra import math_verify_reward
    assert reward.load_reward("math") is tasks.math_reward
    assert reward.load_reward("math-verify") is math_verify_reward.math_verify_reward
    (tmp_path / "my_rewards.py").write_text("def length(prompt, completion, answer):\n    return len(completion)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reward.load_reward("my_rewards:length")("p", "abc", "a") == 3
    assert reward.load_reward(f"{tmp_path / 'my_rewards.py'}:length")("p", "abcd", "a") == 4


@pytest.mark.parametrize("spec, mentioned", [
    ("nonsense", "'math'"),
    ("no_such_module_xyz:f", "no_such_module_xyz"),
    ("missing/file.py:f", "missing/file.py"),
    ("tasks:no_such_function", "no_such_function"),
    ("tasks:GSM8K_REPO", "GSM8K_REPO"),  # exists but is not callable
])
def test_load_reward_errors_name_what_was_not_found(spec, mentioned):
    """Claim: a bad --reward raises RewardError naming the missing module, file or function."""
    with pytest.raises(RewardError) as error:
        reward.load_reward(spec)
    assert mentioned in str(error.value)


@pytest.mark.parametrize("source, said", [
    ("def reward(prompt, completion, answer):\n    return 1.0 +\n", "line 2: SyntaxError: invalid syntax"),
    ("import math\nimport no_such_module_xyz\n", "line 2: ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ("import sys\nsys.exit(3)\n", "line 2: SystemExit: 3"),
    ("import json\nTABLE = json.loads('{bad')\n", "line 2: JSONDecodeError: Expecting property name"),
], ids=["syntax", "import", "exit", "in a library"])
def test_a_reward_file_that_cannot_be_imported_names_its_line(tmp_path, source, said):
    """Claim: a reward file with a syntax error, a missing import or code that fails when imported is one RewardError
    line naming the file and the line; the user's own line, also where the error is raised
    inside a library it calls."""
    path = tmp_path / "broken_reward.py"
    path.write_text(source)
    with pytest.raises(RewardError) as error:
        reward.load_reward(f"{path}:reward")
    assert f"{path}, {said}" in str(error.value) and "\n" not in str(error.value)


@pytest.fixture
def own_imports(monkeypatch):
    """sys.path as it was after the test (and without the working directory as '' or '.', as under
    `python /path/to/trainer.py`), and no module the test imported left in sys.modules."""
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", ".")])
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


DATACLASS_REWARD = ("from __future__ import annotations\n"
                    "from dataclasses import dataclass\n\n"
                    "@dataclass\nclass Scored:\n    value: float\n\n"
                    "def f(prompt, completion, answer):\n    return Scored(len(completion)).value\n")


@pytest.mark.parametrize("stem", ["dataclass_reward", "json"])
def test_a_reward_file_may_define_a_dataclass(tmp_path, own_imports, stem):
    """Claim: a reward file with `from __future__ import annotations` and a @dataclass loads and scores; one named like an existing module (json.py)
    is registered under a name of its own, and that module is still the one `import json` gets."""
    import json
    path = tmp_path / f"{stem}.py"
    path.write_text(DATACLASS_REWARD)
    function = reward.load_reward(f"{path}:f")
    assert function("p", "abc", "a") == 3
    assert sys.modules[function.__module__].__file__ == str(path)
    assert (function.__module__ == "dataclass_reward") is (stem == "dataclass_reward")
    assert sys.modules["json"] is json and reward.load_reward(f"{path}:f") is function  # loaded once, as import is


def test_a_reward_file_may_import_modules_beside_it(tmp_path, own_imports, monkeypatch):
    """Claim: a reward file imports modules from its own folder, when it loads and when it is called, from any working directory."""
    (tmp_path / "rw_helper.py").write_text("def score(completion):\n    return len(completion)\n")
    (tmp_path / "rw_lazy.py").write_text("BONUS = 10\n")
    (tmp_path / "rw_main.py").write_text("from rw_helper import score\n\n"
                                         "def f(prompt, completion, answer):\n"
                                         "    from rw_lazy import BONUS\n"
                                         "    return score(completion) + BONUS\n")
    monkeypatch.chdir(tmp_path.parent)
    assert reward.load_reward(f"{tmp_path.name}/rw_main.py:f")("p", "abc", "a") == 13


def test_a_reward_module_is_found_in_the_working_directory(tmp_path, own_imports, monkeypatch):
    """Claim: `--reward myrw:acc` run from the folder holding myrw.py loads it although sys.path[0] is trainer.py's
    folder, not the working directory."""
    (tmp_path / "myrw.py").write_text("def acc(prompt, completion, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    assert reward.load_reward("myrw:acc")("p", "c", "a") == 1.0


def _load_in_child(specs, folder, results):
    """A spawned process's load_rewards, as inference.worker_main's: each reward's score for 'abc'."""
    os.chdir(folder)
    results.put([function("p", "abc", "a") for function in reward.load_rewards(specs).functions])


def test_a_spawned_process_loads_rewards_alike(tmp_path, own_imports):
    """Claim: a spawned process (an inference worker) loads a dataclass reward file, its neighbour module and a
    module from the working directory as the trainer does."""
    import multiprocessing
    (tmp_path / "rw_helper2.py").write_text("def score(completion):\n    return len(completion)\n")
    (tmp_path / "rw_file.py").write_text(DATACLASS_REWARD + "\nfrom rw_helper2 import score  # noqa: E402\n")
    (tmp_path / "rw_module.py").write_text("def acc(prompt, completion, answer):\n    return 1.0\n")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_load_in_child, args=([f"{tmp_path / 'rw_file.py'}:f", "rw_module:acc"],
                                                         str(tmp_path), results))
    child.start()
    child.join(timeout=60)
    if child.is_alive():  # hung: not left running
        child.kill()
    assert child.exitcode == 0 and results.get(timeout=5) == [3, 1.0]


def test_trls_registry_names_load_trl_rewards(tmp_path, monkeypatch, own_imports):
    """Claim: --reward accuracy_reward (and TRL's CLI's other registry names) loads trl.rewards' function as TRL's CLI
    does (get_soft_overlong_punishment made with TRL's arguments, 1280 and 256); without trl installed it is refused
    in one line naming the pip command. A stand-in trl package here: CI has no trl."""
    package = tmp_path / "trl"
    (package / "rewards").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rewards" / "__init__.py").write_text(
        "def accuracy_reward(completions, solution, **kwargs):\n    return [1.0] * len(completions)\n"
        "def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):\n"
        "    def soft_overlong_punishment_reward(completion_ids, **kwargs):\n"
        "        return [float(max_completion_len + soft_punish_cache)] * len(completion_ids)\n"
        "    return soft_overlong_punishment_reward\n")
    find_spec = importlib.util.find_spec
    with monkeypatch.context() as without_trl:  # as if not installed, on a machine that has it too
        without_trl.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "trl" else find_spec(name, *a))
        with pytest.raises(RewardError, match=r"'accuracy_reward' is TRL's trl.rewards.accuracy_reward, and trl is "
                                              r"not installed: pip install trl \(or --reward math-verify"):
            reward.load_reward("accuracy_reward")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reward.load_reward("accuracy_reward") is importlib.import_module("trl.rewards").accuracy_reward
    punishment = reward.load_reward("get_soft_overlong_punishment")
    assert punishment.__name__ == "soft_overlong_punishment_reward" and punishment([[1], [2]]) == [1536.0, 1536.0]


def test_a_reward_file_with_relative_imports_says_to_name_its_module(tmp_path, monkeypatch):
    """Claim: a reward file inside a package that imports relatively (`from .helper import X`), named by its path,
    fails in one line that names the module form that works (`package.module:function` from the package's parent
    folder), and that form loads."""
    package = tmp_path / "myrewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helper.py").write_text("X = 1.0\n")
    (package / "rw.py").write_text("from .helper import X\n\ndef rel(completions, **kwargs):\n    return [X] * len(completions)\n")
    with pytest.raises(RewardError) as error:
        reward.load_reward(f"{package / 'rw.py'}:rel")
    assert str(error.value).endswith("name it as a module from the package's parent folder, e.g. --reward "
                                     "myrewards.rw:rel")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert reward.load_reward("myrewards.rw:rel")(completions=["a", "b"]) == [1.0, 1.0]
