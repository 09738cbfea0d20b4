"""tests/warm.py, which the process-level tests launch trainer.py through: a command it serves is the command's run
(the same output, exit status, files and signal dispositions as in a fresh interpreter), and a command whose start
it cannot reproduce is refused and run fresh."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]

# What a script sees of its own start, one line each (the test compares a fresh interpreter's with a warm one's).
PROBE = """import os, signal, sys, multiprocessing.process
print(sys.argv)
print(sys.path[0] == os.path.dirname(os.path.abspath(__file__)), __name__, os.path.isabs(__file__))
print(os.getcwd() == multiprocessing.process.ORIGINAL_DIR, os.environ.get("PROBE_VALUE"))
print([signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM)],
      signal.getsignal(signal.SIGINT) is signal.default_int_handler)
print(sys.stdin.read().strip())
sys.stdout.flush()
how = sys.argv[1]
if how == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
if how == "ctrl-c":
    raise KeyboardInterrupt
if how == "error":
    print("error: one line", file=sys.stderr)
    sys.exit(3)
"""


def probe(tmp_path: Path, how: str, served: bool, **kwargs) -> tuple[int, str, str]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "PROBE_VALUE": "7", "GOMP_SPINCOUNT": "30000"}  # as the warm interpreter loaded libgomp
    process = warm.Popen([sys.executable, script.name, how], warm=served, cwd=tmp_path, env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    out, err = process.communicate("from stdin", timeout=120)
    assert (process.served is not None) == served, process.refusal
    return process.returncode, out, err


@pytest.mark.parametrize("how", ["exit", "error", "sigterm", "ctrl-c"])
def test_a_served_script_starts_and_ends_as_in_a_fresh_interpreter(tmp_path, how):
    """Claim: a script served warm sees what a fresh `python SCRIPT.py` sees (its argv, its folder first on sys.path,
    `__main__`, the working folder, the environment, stdin, the signals as from a terminal with SIGHUP ignored) and
    ends the same way: its output, its exit code, death by a signal (-15), an uncaught Ctrl-C (-2: Python's own
    exit by SIGINT)."""
    fresh = probe(tmp_path, how, served=False, terminal_signals=(signal.SIGHUP,))
    served = probe(tmp_path, how, served=True, terminal_signals=(signal.SIGHUP,))
    assert served == fresh
    code, out, _ = served
    assert code == {"exit": 0, "error": 3, "sigterm": -signal.SIGTERM, "ctrl-c": -signal.SIGINT}[how]
    assert out.splitlines()[2:] == ["True 7", "[True, True, True, False] True", "from stdin"]


def test_another_environment_for_the_imports_gets_a_warm_interpreter_of_its_own(tmp_path, monkeypatch):
    """Claim: a command whose environment differs in a variable the imports read (here GOMP_SPINCOUNT, which libgomp
    reads when torch loads it) is served by a warm interpreter started with that environment, never by one whose
    imports saw another, and the next such command by the same one; past MAX_ZYGOTES it runs in a fresh
    interpreter, which says why."""
    monkeypatch.setattr(warm, "ZYGOTES", [])  # this test's own warm interpreters
    script = tmp_path / "probe.py"
    script.write_text("import os\nprint(os.environ['GOMP_SPINCOUNT'])\n")

    def launch(value: str) -> warm.Popen:
        process = warm.Popen([sys.executable, script.name], cwd=tmp_path, env={**os.environ, "GOMP_SPINCOUNT": value},
                             stdout=subprocess.PIPE, text=True)
        assert process.communicate(timeout=120)[0] == f"{value}\n" and process.returncode == 0
        return process

    try:
        first, second, again = (launch(value).served for value in ("30000", "1", "1"))
        assert first.zygote is not second.zygote and second.zygote is again.zygote
        assert (first.zygote.env["GOMP_SPINCOUNT"], second.zygote.env["GOMP_SPINCOUNT"]) == ("30000", "1")
        monkeypatch.setattr(warm, "MAX_ZYGOTES", 2)
        fresh = launch("2")
        assert fresh.served is None and "GOMP_SPINCOUNT" in fresh.refusal
    finally:
        warm.stop()


@pytest.mark.slow  # a fresh trainer.py (~5 s of imports on 2 cores)
def test_a_served_training_run_is_the_fresh_run_bitwise(tiny_model_dir, tmp_path):
    """Claim: `python trainer.py` served warm trains exactly as a fresh interpreter does: the same exit code and
    stderr, the same metrics but for the clock's, and the same saved policy, bitwise (same seed, same threads)."""
    runs = {}
    for served in (False, True):
        out = tmp_path / ("warm" if served else "fresh")
        process = warm.Popen(
            [sys.executable, "trainer.py", "--model", str(tiny_model_dir), "--data", "arithmetic", "--mode", "async",
             "--iterations", "2", "--batch-size", "8", "--group-size", "4", "--max-new-tokens", "4", "--eval-every",
             "1", "--eval-size", "4", "--groups-per-call", "1", "--micro-batch-tokens", "16384", "--rollout-threads",
             "1", "--train-threads", "1", "--out", str(out)],
            warm=served, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0 and (process.served is not None) == served, (process.refusal, err)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        clock = ("_s", "time", "tok/s", "tokens_per_second", "idle", "overlap")
        runs[served] = (err, [{k: v for k, v in row.items() if not any(c in k for c in clock)} for row in rows],
                        load_file(out / "policy" / "model.safetensors"))
    (err_f, rows_f, weights_f), (err_w, rows_w, weights_w) = runs[False], runs[True]
    assert err_w == err_f and rows_w == rows_f and len(rows_f) == 3
    assert weights_w.keys() == weights_f.keys() and all(torch.equal(weights_w[k], weights_f[k]) for k in weights_f)
