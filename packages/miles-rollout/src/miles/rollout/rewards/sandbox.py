"""Run a model-written Python program under resource limits, for code-execution rewards.

One call, one program, one input: a fresh temporary directory (removed afterwards, also after a timeout) is the
working directory of ``python -I -B -X utf8`` (isolated: no PYTHON* variables, no user site, no script directory
on ``sys.path``; no ``.pyc`` writes), started in its own session with a minimal environment. Before the program
runs, a preamble in the child sets ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (output and file size)
and ``RLIMIT_CORE`` 0, and installs a ``sys.addaudithook`` hook (hooks cannot be removed) that ends the program at
once (exit code, no exception the program could catch) on:

- network: every ``socket.*`` event (create, connect, bind, DNS look-up);
- process: ``os.fork``/``os.forkpty``/``os.system``/``os.exec*``/``os.posix_spawn``/``os.spawn*``,
  ``subprocess.Popen``, ``os.kill``/``os.killpg`` (root could kill the trainer), ``resource.setrlimit``/
  ``prlimit`` (root could lift the limits), and importing ``_posixsubprocess``, ``ctypes`` or ``_cffi_backend``
  (native routes around these events; so ``import subprocess`` is blocked too);
- filesystem: opening a file for writing, creating, removing or renaming outside the working directory (or, but
  for ``open``, relative to a ``dir_fd``), any ``chmod``/``chown``/``link``/``symlink`` (no way to leave
  undeletable files or paths out of the directory).

A wall-clock limit, timed here, SIGKILLs the whole process group (what the program started, if anything got
through, included). ``RLIMIT_NPROC`` is not set: it counts every task of the user, the trainer's threads included,
so a value low enough to stop a fork bomb also stops the program's threads (a common deep-recursion trick), and
root ignores it; the audit hook blocks process creation instead.

Limits: this contains accidents and careless or reward-hacking model code; it is no security boundary against code
written to escape (audit hooks are not a sandbox: C extensions and interpreter internals can bypass them; files
outside the working directory stay readable). Run the trainer in a container (or use nsjail/bubblewrap) for
adversarial code.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

# What the program's run ended with. ok: exit code 0 (its output is then compared by the caller).
Outcome = Literal[
    "ok", "timeout", "memory", "output_limit", "blocked_network", "blocked_process", "blocked_filesystem", "error"
]

# Exit codes the preamble's audit hook ends the program with (a program exiting with one itself only mislabels its
# own failure: every one of them scores 0).
_BLOCKED_EXIT = {97: "blocked_network", 98: "blocked_process", 99: "blocked_filesystem"}
# Bytes of the program's stdout and of its stderr read back; RLIMIT_FSIZE caps every file it writes at this.
MAX_OUTPUT_BYTES = 16 * 2**20
_STDERR_TAIL = 4096  # bytes of stderr kept for the failure reason
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")

# Runs in the child before the program, from argv: memory limit (bytes), CPU limit (s), file-size limit (bytes).
# Everything is local to _sandbox, so the program's globals hold no reference to the hook.
_PREAMBLE = r"""
def _sandbox():
    import os, resource, sys

    memory, cpu, fsize = (int(a) for a in sys.argv[1:4])
    for limit, soft, hard in ((resource.RLIMIT_AS, memory, memory), (resource.RLIMIT_CPU, cpu, cpu + 1),
                              (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_CORE, 0, 0)):
        inherited = resource.getrlimit(limit)[1]  # e.g. a reward worker's reward.memory_limit_mib: only lower it
        if inherited != resource.RLIM_INFINITY:
            soft, hard = min(soft, inherited), min(hard, inherited)
        resource.setrlimit(limit, (soft, hard))
    root = os.getcwd()
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    process_events = frozenset(("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
        "subprocess.Popen", "os.kill", "os.killpg", "resource.setrlimit", "resource.prlimit", "os.startfile"))
    native_modules = frozenset(("_posixsubprocess", "ctypes", "_ctypes", "_cffi_backend"))
    # event -> (positions of paths that must be inside the directory, positions of dir_fd arguments)
    path_events = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
        "os.rename": ((0, 1), (2, 3)), "os.truncate": ((0,), ()), "os.utime": ((0,), (3,)),
        "shutil.rmtree": ((0,), (1,)), "shutil.copyfile": ((1,), ()), "shutil.copytree": ((1,), ()),
        "shutil.move": ((0, 1), ())}
    never_events = frozenset(("os.chmod", "os.chown", "os.chflags", "os.lchflags", "os.link", "os.symlink",
        "shutil.chown", "os.setxattr", "os.removexattr"))
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    fspath, abspath, fsdecode, write, exit_now = os.fspath, os.path.abspath, os.fsdecode, os.write, os._exit

    def inside(path):
        if isinstance(path, int):  # an open file descriptor
            return True
        path = abspath(fsdecode(fspath(path)))
        return path == root or path.startswith(root + "/") or path == "/dev/null"

    def block(code, event):
        write(2, ("\nmiles-sandbox: blocked " + event + "\n").encode())
        exit_now(code)

    def hook(event, args):
        if event.startswith("socket."):
            block(97, event)
        elif event in process_events or (event == "import" and args[0].partition(".")[0] in native_modules):
            block(98, event if event != "import" else "import " + args[0])
        elif event == "open":
            if args[2] & write_flags and not inside(args[0]):
                block(99, "open for writing " + repr(args[0]))
        elif event in never_events:
            block(99, event)
        elif event in path_events:
            paths, dir_fds = path_events[event]
            if any(args[i] not in (None, -1) for i in dir_fds) or not all(inside(args[i]) for i in paths):
                block(99, event + " " + repr(args[0]))

    sys.addaudithook(hook)
    sys.argv = ["solution.py"]
    return compile(source, "solution.py", "exec")


_code = _sandbox()
del _sandbox
exec(_code, {"__name__": "__main__", "__file__": "solution.py", "__builtins__": __builtins__})
"""


@dataclass(frozen=True, slots=True)
class ProgramRun:
    """How one run of a program ended.

    Attributes:
        outcome: ok (exit code 0), timeout (past the wall-clock or CPU limit), memory (MemoryError: past the
            memory limit), output_limit (a write past ``MAX_OUTPUT_BYTES``), blocked_network / blocked_process /
            blocked_filesystem (the audit hook ended it), error (anything else: an exception, a non-zero exit, a
            signal).
        detail: for error the exception type (``NameError``), ``exit code N`` or ``signal SIGSEGV``; for blocked
            the event (``socket.connect``); else empty.
        stdout: what the program printed, UTF-8 decoded (invalid bytes replaced), at most ``MAX_OUTPUT_BYTES``.
        seconds: wall-clock seconds the run took.
    """

    outcome: Outcome
    detail: str
    stdout: str
    seconds: float


def run_program(
    source: str, *, stdin: str = "", time_limit_s: float, memory_limit_mib: int, tmp_root: str | None = None
) -> ProgramRun:
    """Run the Python program ``source`` with ``stdin`` as its standard input, sandboxed as the module says.

    Args:
        source: the program's text, run as ``__main__``.
        stdin: its whole standard input.
        time_limit_s: wall-clock seconds before its process group is killed (outcome timeout); RLIMIT_CPU is this
            rounded up, plus 1 s.
        memory_limit_mib: its address space (RLIMIT_AS, MiB), the interpreter's ~15 MiB included.
        tmp_root: where the temporary directory is made; None = ``tempfile.gettempdir()``.
    Returns: a ``ProgramRun``; the temporary directory is gone and no process of the run is left.
    Raises: ValueError for a time or memory limit <= 0; OSError if the directory or the process cannot be made,
        or the directory cannot be removed.
    """
    if time_limit_s <= 0 or memory_limit_mib <= 0:
        raise ValueError(f"time_limit_s={time_limit_s} and memory_limit_mib={memory_limit_mib} must be > 0")
    tmp = tempfile.mkdtemp(prefix="miles-sandbox-", dir=tmp_root)
    try:
        work, io_dir = os.path.join(tmp, "work"), os.path.join(tmp, "io")  # the program may write only in work/
        os.mkdir(work)
        os.mkdir(io_dir)
        with open(os.path.join(work, "solution.py"), "w", encoding="utf-8") as f:
            f.write(source)
        with open(os.path.join(io_dir, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        limits = (memory_limit_mib * 2**20, math.ceil(time_limit_s) + 1, MAX_OUTPUT_BYTES)
        command = [sys.executable, "-I", "-B", "-X", "utf8", "-c", _PREAMBLE, *map(str, limits)]
        env = {"PATH": os.defpath, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
        paths = [os.path.join(io_dir, name) for name in ("stdin", "stdout", "stderr")]
        t0 = time.perf_counter()
        with open(paths[0], "rb") as stdin_f, open(paths[1], "wb") as stdout_f, open(paths[2], "wb") as stderr_f:
            process = subprocess.Popen(
                command, stdin=stdin_f, stdout=stdout_f, stderr=stderr_f, cwd=work, env=env, start_new_session=True
            )
        in_time = _wait_and_kill_group(process, time_limit_s)
        seconds = time.perf_counter() - t0
        stdout = _read(paths[1], MAX_OUTPUT_BYTES)
        stderr_tail = _read(paths[2], _STDERR_TAIL, tail=True)
    finally:
        shutil.rmtree(tmp)
    outcome, detail = ("timeout", "") if not in_time else _classify(process.returncode, stderr_tail)
    return ProgramRun(outcome, detail, stdout, seconds)


def _wait_and_kill_group(process: subprocess.Popen, time_limit_s: float) -> bool:
    """Wait up to ``time_limit_s`` for the process to exit, SIGKILL its process group, reap it; True if it exited
    in time. The group is killed before the leader is reaped: while it is a zombie its pid still names the group
    (no other group can take that id), so the signal reaches the run's processes and nothing else."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:  # a kernel before 5.3: wait() reaps, so a straggler after the leader exits is not killed
        try:
            process.wait(time_limit_s)
            return True
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        exited = bool(poller.poll(math.ceil(time_limit_s * 1000)))
    finally:  # also on KeyboardInterrupt: nothing of the run outlives this call
        os.close(pidfd)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return exited


def _read(path: str, limit: int, *, tail: bool = False) -> str:
    with open(path, "rb") as f:
        if tail:
            f.seek(max(0, os.path.getsize(path) - limit))
        return f.read(limit).decode("utf-8", errors="replace")


def _classify(returncode: int, stderr_tail: str) -> tuple[Outcome, str]:
    """(outcome, detail) of a run that ended within its time limit."""
    if returncode == 0:
        return "ok", ""
    lines = stderr_tail.strip().splitlines()
    last = lines[-1] if lines else ""
    if returncode in _BLOCKED_EXIT and last.startswith("miles-sandbox: blocked "):
        return _BLOCKED_EXIT[returncode], last.removeprefix("miles-sandbox: blocked ")
    if returncode < 0:
        sig = signal.Signals(-returncode)
        if sig == signal.SIGXCPU or sig == signal.SIGKILL:  # RLIMIT_CPU: SIGXCPU at the soft, SIGKILL at the hard
            return "timeout", ""
        if sig == signal.SIGXFSZ:
            return "output_limit", ""
        return "error", f"signal {sig.name}"
    match = _EXCEPTION_LINE.match(last)
    if returncode == 1 and match is not None:  # an uncaught exception: the traceback's last line names it
        name = match.group(1)
        if name == "MemoryError":
            return "memory", ""
        if name == "OSError" and "File too large" in last:  # RLIMIT_FSIZE with SIGXFSZ ignored
            return "output_limit", ""
        return "error", name
    return "error", f"exit code {returncode}"
