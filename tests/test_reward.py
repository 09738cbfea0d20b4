"""infra/reward.py: a reward named by --reward is loaded, or its problem is one line naming the file, module or function."""
import importlib
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
], ids=["syntax", "import", "exit"])
def test_a_reward_file_that_cannot_be_imported_names_its_line(tmp_path, source, said):
    """Claim: a reward file with a syntax error, a missing import or code that fails when imported is one RewardError
    line naming the file and the line (it was a traceback)."""
    path = tmp_path / "broken_reward.py"
    path.write_text(source)
    with pytest.raises(RewardError) as error:
        reward.load_reward(f"{path}:reward")
    assert f"{path}, {said}" in str(error.value) and "\n" not in str(error.value)


@pytest.fixture
def old_names_fresh(monkeypatch):
    """No old name imported yet and a fresh finder (nothing told), both as they were after the test."""
    from infra import moved
    monkeypatch.setattr(sys, "meta_path", [finder for finder in sys.meta_path
                                           if not isinstance(finder, moved.MovedModules)])
    for old in moved.MOVED:
        monkeypatch.delitem(sys.modules, old, raising=False)
    yield
    for old in moved.MOVED:  # imported by the test; monkeypatch then puts back any that were there before
        sys.modules.pop(old, None)


def test_a_reward_file_may_import_modules_by_their_old_names(tmp_path, capfd, old_names_fresh):
    """Claim: a reward file written before the re-layout (`from tasks import math_reward`, `import reward`) loads
    and scores; each old name is the new module itself and says once on stderr where it moved."""
    path = tmp_path / "old_style.py"
    path.write_text("from tasks import math_reward\nimport reward\nimport tasks\n\n"
                    "def f(prompt, completion, answer):\n"
                    "    assert reward.math_reward is math_reward\n"
                    "    return math_reward(prompt, completion, answer)\n")
    function = reward.load_reward(f"{path}:f")
    reward.load_reward(f"{path}:f")  # a second load says nothing more
    assert function("2 + 2?", "The answer is 4", "4") == 1.0
    assert sys.modules["tasks"] is sys.modules["infra.tasks"] and sys.modules["reward"] is reward
    assert tasks.__spec__.name == "infra.tasks"  # the module keeps its own spec
    lines = capfd.readouterr().err.splitlines()
    assert lines.count("periodic-rl: module 'tasks' moved to 'infra.tasks'; import it from there") == 1
    assert lines.count("periodic-rl: module 'reward' moved to 'infra.reward'; import it from there") == 1


def test_a_name_that_never_existed_is_still_not_found(old_names_fresh):
    """Claim: the old names are the only ones the finder answers: any other missing module is ModuleNotFoundError."""
    from infra import moved
    moved.install()
    moved.install()  # idempotent: one finder
    assert sum(isinstance(finder, moved.MovedModules) for finder in sys.meta_path) == 1
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("no_such_old_module_xyz")
