"""`python trainer.py ...` for the tests, started from a warm interpreter: a fork of a process that has already
imported torch and transformers, so that a test pays for its run and not for ~3 s of imports (most of what the
process-level tests cost on a 2-core machine: docs/design.md, "The suite on a busy machine").

    done = warm.run([sys.executable, "trainer.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    process = warm.Popen([sys.executable, "trainer.py", *args], stdout=PIPE, start_new_session=True)

`Popen` and `run` are subprocess's, call for call. What a test checks is the run's own: its exit code (as Popen
gives it: -N after signal N), its stdout and stderr (the descriptors are passed whole), its files, the processes it
starts (the inference process is spawned as always: a fresh interpreter), the signals it gets (a process of its own
PID, in a session of its own when asked). What differs is the interpreter's start alone, so a command is served
warm only where that start cannot show:
- the command is `sys.executable SCRIPT.py ARGS` (no interpreter option, no shell) for a script that exists, with
  no preexec_fn, user, group, umask or extra descriptor, and no terminal on stdin, stdout or stderr;
- every environment variable that the warm interpreter's imports read (recorded while it imported), or that C
  libraries read when they load (`C_PREFIXES`), is what the command's environment would give a fresh interpreter
  (trainer.py and bench.py set GOMP_SPINCOUNT before torch loads, launch/start.shorten_openmp_spinning: so does
  their warm interpreter); an environment that differs there gets a warm interpreter of its own (up to
  MAX_ZYGOTES);
- those imports wrote nothing (a warning a fresh run would print is not swallowed) and left CUDA uninitialised;
- the test does not ask for a fresh interpreter (`warm=False`: the claims about start-up itself).
Anything else is an ordinary fork-exec (`refusal` says why). In the forked process, as in a fresh one: the
signals are at their defaults (Ctrl-C raises KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored) but for those the
test process ignores (an exec keeps them ignored; `terminal_signals`: but Ctrl-C's, SIGHUP and SIGQUIT, and these);
the script runs as `__main__` with its folder first on sys.path, and an uncaught exception's report shows the
script's frames alone; multiprocessing's start folder and authkey, and numpy's global random state, are the
process's own. (Python's string hashing seed is the warm interpreter's, shared by the commands it serves.)
"""
from __future__ import annotations

import atexit
import inspect
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from contextlib import suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "numpy", "safetensors.torch", "transformers", "transformers.modeling_utils",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.generation")
# Read below Python's os.environ (by C libraries, when they load), or looked for by prefix on import:
C_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "TORCH", "PYTORCH", "ATEN_",
              "LD_", "MALLOC", "CUDA", "NCCL", "LANG", "LC_", "TZ", "TQDM_", "FSSPEC_")
SHORTENS_SPINNING = ("trainer.py", "bench.py")  # they call shorten_openmp_spinning before torch loads
EXECUTE_CHILD = inspect.signature(subprocess.Popen._execute_child)


def as_from_a_terminal(ignored: tuple[int, ...] = ()):
    """A Popen `preexec_fn`: the child starts with Ctrl-C's SIGINT, SIGHUP and SIGQUIT at their defaults, as a command
    typed in a terminal does, whatever the test process inherited (a suite started by `nohup` or as a background job
    `&` ignores them, and an ignored signal stays ignored through exec: the trainer then rightly keeps ignoring it,
    and a test of Ctrl-C would fail for want of one); then ignores the signals in `ignored` (a launcher that does)."""
    def reset() -> None:
        for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(signum, signal.SIG_DFL)
        for signum in ignored:
            signal.signal(signum, signal.SIG_IGN)
    return reset


class Popen(subprocess.Popen):
    """subprocess.Popen, served warm where it can be (the module's docstring). `warm=False`: always a fork-exec.
    `terminal_signals`: start as from a terminal (`as_from_a_terminal`), ignoring these."""

    def __init__(self, args, *, warm: bool = True, terminal_signals: tuple[int, ...] | None = None, **kwargs):
        self.served, self.refusal, self._wanted, self._terminal = None, None, warm, terminal_signals
        if terminal_signals is not None:
            kwargs["preexec_fn"] = as_from_a_terminal(terminal_signals)
        super().__init__(args, **kwargs)

    def _execute_child(self, *args):
        call = EXECUTE_CHILD.bind(self, *args).arguments
        self.refusal = "warm=False" if not self._wanted else refusal(call, self._terminal is not None)
        if self.refusal is None:
            answer, self.served = fork(call["args"][1:], os.path.abspath(call["cwd"] or os.getcwd()),
                                       script_env(call), call["start_new_session"], self.ignored(),
                                       [call[name] if call[name] != -1 else fd for name, fd in STDIO])
            self.refusal = answer.get("refused")
            if self.refusal is None:
                self.pid, self._child_created = answer["pid"], True
                self._close_pipe_fds(*(call[name] for name in ("p2cread", "p2cwrite", "c2pread", "c2pwrite",
                                                               "errread", "errwrite")))
                return
        self.served = None
        super()._execute_child(*args)

    def ignored(self) -> set[int]:
        """The signals the script starts ignoring: those this process ignores (an exec keeps them ignored), but
        Ctrl-C's, SIGHUP and SIGQUIT as from a terminal, where asked, ignoring `terminal_signals` instead."""
        if self._terminal is None:
            return inherited_ignored()
        return inherited_ignored() - {signal.SIGINT, signal.SIGHUP, signal.SIGQUIT} | set(self._terminal)

    def _internal_poll(self, _deadstate=None, **kwargs):
        if self.served is None:
            return super()._internal_poll(_deadstate=_deadstate, **kwargs)
        if self.returncode is None:
            try:
                self.returncode = self.served.returncode(timeout=0)
            except ZygoteLost:
                if _deadstate is None:
                    raise
                self.returncode = _deadstate  # (subprocess's clean-up of a forgotten Popen)
        return self.returncode

    def _wait(self, timeout):
        if self.served is None:
            return super()._wait(timeout)
        if self.returncode is None:
            self.returncode = self.served.returncode(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


STDIO = (("p2cread", 0), ("c2pwrite", 1), ("errwrite", 2))  # the child's stdin, stdout, stderr (-1: this process's)


def run(args, *, input=None, capture_output=False, timeout=None, check=False, warm: bool = True,
        **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, through `Popen` (as CPython's, on POSIX)."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, warm=warm, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        except BaseException:
            process.kill()
            raise
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, process.args, stdout, stderr)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def refusal(call: dict, terminal: bool) -> str | None:
    """Why the command cannot be served warm (None: it can)."""
    argv = call["args"]
    if call["shell"] or call["executable"] is not None or isinstance(argv, (str, bytes)):
        return "not an argument list"
    if len(argv) < 2 or argv[0] != sys.executable or not str(argv[1]).endswith(".py"):
        return "not `python SCRIPT.py ...`"
    if not os.path.isfile(os.path.join(call["cwd"] or os.getcwd(), argv[1])):
        return "no such script (Python's own error is a fresh interpreter's)"
    preexec = call["preexec_fn"] is not None and not terminal  # (`terminal_signals` is served)
    ids = call["uid"] is not None or call["gid"] is not None or call["gids"] is not None
    descriptors = bool(call["pass_fds"]) or not call["close_fds"]
    start = not call["restore_signals"] or call["umask"] != -1 or call.get("process_group", -1) not in (-1, None)
    if preexec or ids or descriptors or start:
        return "a process option the warm start does not take"
    if any(os.isatty(call[name] if call[name] != -1 else fd) for name, fd in STDIO):
        return "a terminal (Python buffers its output by that at start-up)"
    return None


def script_env(call: dict) -> dict:
    """The environment the script starts with: the call's (None: this process's)."""
    return {str(k): str(v) for k, v in (call["env"] if call["env"] is not None else os.environ).items()}


def inherited_ignored() -> set[int]:
    """The signals this process ignores: an exec'd child starts ignoring them too (SIGPIPE and SIGXFSZ aside,
    which Popen restores and Python then ignores itself)."""
    return {int(s) for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) == signal.SIG_IGN}


class ZygoteLost(RuntimeError):
    """The warm interpreter ended while a process it forked ran: that process's exit status is lost."""


class Served:
    """One command served warm: the process's warm interpreter, and the connection on which it reports the exit."""

    def __init__(self, zygote: Zygote, connection: socket.socket):
        self.zygote, self.connection, self._returncode, self._lock = zygote, connection, None, threading.Lock()

    def returncode(self, timeout: float | None) -> int | None:
        """The process's exit code, as Popen's (-N: killed by signal N), once it has ended; None while it runs
        after `timeout` s, or while another thread waits for it (as Popen's poll)."""
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return None
        try:
            if self._returncode is None:
                self.connection.settimeout(None if timeout is None else max(0.0, timeout))
                try:
                    message = self.connection.recv(1 << 16)
                except (TimeoutError, BlockingIOError):
                    return None
                if not message:
                    raise ZygoteLost(f"the warm interpreter (PID {self.zygote.process.pid}) ended while its "
                                     "process ran")
                self._returncode = json.loads(message)["returncode"]
                self.connection.close()
            return self._returncode
        finally:
            self._lock.release()


class Zygote:
    """A warm interpreter: `python tests/warm.py SOCKET`, started with the environment `env`, importing PRELOAD.
    `unclean` says why it serves nothing (it did not start, its imports wrote or initialised CUDA, it ended)."""

    def __init__(self, env: dict, start_seconds: float = 300):
        self.env, self.watched, self.unclean = env, frozenset(), None
        self.folder = tempfile.mkdtemp(prefix="periodic-rl-warm-")
        self.socket = os.path.join(self.folder, "socket")
        with open(os.path.join(self.folder, "stderr"), "w+") as stderr:
            self.process = subprocess.Popen([sys.executable, __file__, self.socket], cwd=ROOT, env=env,
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, text=True)
            ready = self.process.stdout.readline() if select.select([self.process.stdout], [], [],
                                                                     start_seconds)[0] else ""
            stderr.seek(0)
            written = stderr.read()
        try:
            imported = json.loads(ready)
        except ValueError:
            self.end(f"the warm interpreter did not start: {(ready + written)[-300:]!r}")
            return
        self.watched = frozenset(imported["watched"])
        if imported["scans"]:
            self.end(f"the warm interpreter's imports read the whole environment: {imported['scans'][:3]}")
        elif imported["cuda"]:
            self.end("the warm interpreter's imports initialised CUDA, which a fork cannot use")
        elif written:
            self.end(f"the warm interpreter's imports wrote to stderr: {written[:200]!r}")

    def differs(self, env: dict) -> list[str]:
        """The variables that its imports read (or that C libraries read) which `env` gives other values."""
        return sorted(name for name in set(env) | set(self.env)
                      if (name in self.watched or name.startswith(C_PREFIXES)) and env.get(name) != self.env.get(name))

    def fork(self, argv, cwd: str, env: dict, new_session: bool, ignored, fds) -> tuple[dict, Served | None]:
        request = {"argv": [str(a) for a in argv], "cwd": cwd, "env": env, "new_session": bool(new_session),
                   "ignored": sorted(int(s) for s in ignored)}
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            connection.connect(self.socket)
            socket.send_fds(connection, [json.dumps(request).encode()], list(fds))
            answer = connection.recv(1 << 16)
        except OSError as error:
            answer, self.unclean = b"", f"the warm interpreter is unreachable: {error}"
        if not answer:
            connection.close()
            self.unclean = self.unclean or "the warm interpreter has ended"
            return {"refused": self.unclean}, None
        return json.loads(answer), Served(self, connection)

    def end(self, why: str) -> None:
        """Serve nothing more, saying `why`; the interpreter is stopped."""
        self.unclean = why
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


ZYGOTES: list[Zygote] = []  # this process's, one per environment that their imports read differently
MAX_ZYGOTES = 3
_STARTING = threading.Lock()


def fork(argv, cwd: str, env: dict, new_session: bool, ignored, fds) -> tuple[dict, Served | None]:
    """Run `argv` (SCRIPT.py ARGS) in a fork of the warm interpreter whose imports saw what a fresh interpreter
    started with `env` would: ({"pid": N}, its status) or ({"refused": why}, None)."""
    expected = dict(env)  # what the imports see: trainer.py and bench.py shorten OpenMP's spinning first
    if os.path.basename(str(argv[0])) in SHORTENS_SPINNING:
        from launch.start import shorten_openmp_spinning
        shorten_openmp_spinning(expected)
    zygote = zygote_for(expected)
    if isinstance(zygote, str):
        return {"refused": zygote}, None
    return zygote.fork(argv, cwd, env, new_session, ignored, fds)


def zygote_for(env: dict) -> Zygote | str:
    """The warm interpreter for `env` (started if none fits and fewer than MAX_ZYGOTES run), or why there is none."""
    with _STARTING:
        for zygote in ZYGOTES:
            if zygote.unclean:
                return zygote.unclean
            if not zygote.differs(env):
                return zygote
        if len(ZYGOTES) >= MAX_ZYGOTES:
            return (f"{MAX_ZYGOTES} warm interpreters run, none with this environment (it differs in "
                    f"{', '.join(ZYGOTES[-1].differs(env)[:5])})")
        if not ZYGOTES:
            atexit.register(stop)
        ZYGOTES.append(Zygote(env))
        return ZYGOTES[-1].unclean or ZYGOTES[-1]


def zygote_pids() -> set[int]:
    """The warm interpreters' PIDs (children of this process, none of them a test's run)."""
    return {zygote.process.pid for zygote in ZYGOTES}


def stop() -> None:
    for zygote in ZYGOTES:
        zygote.stop()


# --- the warm interpreter (run as `python tests/warm.py SOCKET`) ---

def imports_recording_reads() -> tuple[frozenset, list[str]]:
    """Import PRELOAD, recording the environment variables read on the way: (the names read, the files that went
    through the whole environment other than tqdm's and fsspec's, which look for their prefixes in C_PREFIXES)."""
    read, scans = set(), []
    environ_class = type(os.environ)
    getitem, iterate = environ_class.__getitem__, environ_class.__iter__

    def by_prefix() -> str | None:
        """The file that reads the environment (None: tqdm or fsspec, which look for their own prefixes)."""
        frame = sys._getframe(2)
        while frame.f_code.co_filename.startswith("<frozen") or frame.f_code.co_filename == os.__file__:
            frame = frame.f_back
        caller = frame.f_code.co_filename
        return None if any(f"{os.sep}{name}{os.sep}" in caller for name in ("tqdm", "fsspec")) else caller

    def recorded_getitem(self, key):
        if by_prefix() is not None:
            read.add(key)
        return getitem(self, key)

    def recorded_iter(self):
        caller = by_prefix()
        if caller is not None:
            scans.append(caller)
        return iterate(self)

    environ_class.__getitem__, environ_class.__iter__ = recorded_getitem, recorded_iter
    try:
        import importlib
        for name in PRELOAD:
            importlib.import_module(name)
    finally:
        environ_class.__getitem__, environ_class.__iter__ = getitem, iterate
    return frozenset(read), scans


def listening(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    return listener


def serve(listener: socket.socket) -> tuple[dict, list[int]]:
    """Accept commands on `listener`; fork one process per command and report its wait status on the command's
    connection. Returns in the forked process alone: (the command, its descriptors)."""
    import selectors
    parent = os.getppid()
    running: dict[int, socket.socket] = {}
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        while os.getppid() == parent:  # ends with the test process
            if selector.select(timeout=0.05):
                connection, _ = listener.accept()
                try:
                    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                    request = json.loads(message)
                except (OSError, ValueError):  # the test process went away mid-request: nothing to run
                    connection.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for other in (listener, *running.values(), connection):
                        other.close()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                try:
                    connection.sendall(json.dumps({"pid": pid}).encode())
                    running[pid] = connection
                except OSError:  # nobody will wait for it: it does not run on
                    os.kill(pid, signal.SIGKILL)
                    connection.close()
            while running and (ended := os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)):
                code = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
                connection = running.pop(ended.si_pid, None)
                if connection is not None:  # said before the PID is reaped (a poll that comes later finds it ended)
                    with suppress(OSError):  # (the test process stopped listening)
                        connection.sendall(json.dumps({"returncode": code}).encode())
                    connection.close()
                os.waitpid(ended.si_pid, 0)
    folder = os.path.dirname(listener.getsockname())
    if os.path.basename(folder).startswith("periodic-rl-warm-"):  # its test process ended first: its folder goes
        shutil.rmtree(folder, ignore_errors=True)
    raise SystemExit(0)


def become(request: dict, fds: list[int]) -> None:
    """In the forked process: take the command's descriptors, folder, environment and signals, and run its script
    as `__main__`, as `python SCRIPT.py ARGS` would."""
    import builtins
    import importlib.machinery
    import multiprocessing.process
    import types
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    ignored = set(request["ignored"]) | {signal.SIGPIPE, signal.SIGXFSZ}
    for signum in signal.valid_signals():
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    multiprocessing.process.ORIGINAL_DIR = os.getcwd()
    multiprocessing.current_process().authkey = os.urandom(32)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    script = os.path.abspath(request["argv"][0])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(script)
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__, main.__cached__, main.__spec__ = script, builtins, None, None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    sys.modules["__main__"] = main
    sys.excepthook = without_warm_frames
    exec(compile(Path(script).read_bytes(), script, "exec", dont_inherit=True), main.__dict__)  # noqa: S102


def without_warm_frames(kind, error, traceback) -> None:
    """Python's report of an uncaught exception, without this file's frames above the script's (as a fresh
    interpreter prints it)."""
    while traceback is not None and traceback.tb_frame.f_code.co_filename == __file__:
        traceback = traceback.tb_next
    sys.__excepthook__(kind, error.with_traceback(traceback), traceback)  # Python prints the error's own


if __name__ == "__main__":
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (an ignored SIGCHLD, inherited, would reap its processes itself)
    watched, scans = imports_recording_reads()
    listener = listening(sys.argv[1])
    cuda = sys.modules["torch"].cuda.is_initialized()
    print(json.dumps({"watched": sorted(watched), "scans": scans, "cuda": cuda}), flush=True)
    become(*serve(listener))
