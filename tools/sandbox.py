"""Run untrusted Python in a resource-limited subprocess: the ``python`` tool and PythonTask's hidden tests use it.

What every `run_python` call does:

- Creates a fresh temporary directory, writes the program there as ``main.py`` (plus any extra ``files``), and
  uses it as the working directory, ``HOME`` and ``TMPDIR``. The directory is deleted afterwards.
- Runs the program with ``python3 -I -X utf8``: isolated mode ignores ``PYTHON*`` variables and the user site, and
  puts neither the script's directory nor the cwd on ``sys.path`` (so ``import solution`` needs
  ``sys.path.insert(0, "")`` in the program).
- Scrubs the environment: the child sees ``PATH``, ``HOME``, ``TMPDIR``, ``LANG``/``LC_ALL`` and
  ``SandboxConfig.extra_env``, nothing else of the parent's (no tokens, no keys).
- Runs the program in its own network namespace, where only an unconfigured loopback interface exists (it is
  down: even ``127.0.0.1`` is unreachable), so the program can neither reach the network nor services listening
  on the host's loopback. As root the namespace is created (``unshare(CLONE_NEWNET)``) before the uid switch;
  otherwise, or without ``CAP_SYS_ADMIN``, inside a new user namespace (``CLONE_NEWUSER | CLONE_NEWNET``) where
  the kernel allows unprivileged user namespaces (the program then sees itself as uid 65534, the kernel's
  overflow id). Where neither works, nothing is run: ``NetworkIsolationUnavailable`` says so, unless
  ``SandboxConfig.allow_network`` is set, which runs programs with the host's network (fail closed).
- When the parent runs as root, switches the child to uid/gid 65534 (nobody/nogroup, no supplementary groups)
  before anything runs. This is what makes the process limit bind at all (the kernel does not apply
  ``RLIMIT_NPROC`` to root: 20 forks pass a limit of 5) and what keeps the program from writing anywhere root
  owns (the repository, the trajectory store). The interpreter must be executable by that user, hence the system
  ``python3`` by default (a pyenv or venv under ``/root`` is not).
- Sets rlimits in the child before the program starts: CPU seconds (``SIGXCPU``, then ``SIGKILL`` a second later),
  address space, number of processes, file size (Python ignores ``SIGXFSZ``, so big writes fail with ``EFBIG``),
  open files, and no core dumps.
- Starts the child in a new session and kills the whole process group with ``SIGKILL`` at the wall-clock timeout,
  and also as soon as the main process exits, so background children do not outlive the run.
- Captures stdout and stderr up to ``max_output_bytes`` each; the rest is read, counted and dropped.

What it does not do (it is a guard against runaway and careless code, not a security boundary):

- With ``allow_network=True`` there is no network isolation: the program can open connections.
- Unix-domain sockets bound to a path stay reachable (the filesystem is shared; the network namespace hides only
  abstract ones): a socket file that uid 65534 may write to, such as a world-writable ``docker.sock``, is a way out.
- No seccomp filter and no filesystem namespace: the program can read whatever is world-readable and write
  wherever uid 65534 may (world-writable directories such as ``/tmp``).
- Not running as root, there is no uid change: the program runs as you and can write wherever you can, and
  ``RLIMIT_NPROC`` counts all of your processes.
- ``RLIMIT_NPROC`` is per user, so concurrent sandboxes share it; it counts threads too.
- ``RLIMIT_AS`` bounds virtual memory, which is a proxy for RSS, not RSS itself.
- A grandchild that starts its own session escapes the group kill; its CPU limit still applies, sleeping does not
  consume it.

For adversarial code at scale, run this inside a container or a gVisor / nsjail sandbox.
"""

from __future__ import annotations

import codecs
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import IO

from pydantic import BaseModel, ConfigDict, Field

SANDBOX_UID = 65534
"""``nobody`` on Debian/Ubuntu and most other distributions."""
SANDBOX_GID = 65534
"""``nogroup``."""
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
PROGRAM_NAME = "main.py"
MiB = 1 << 20

_CHUNK_BYTES = 1 << 16
_POLL_S = 0.05
_DRAIN_GRACE_S = 1.0
"""After the main process is gone, how long to keep reading what is still buffered in the pipes."""

# Runs in the child as the parent's user, before the program: create the network namespace (while still root, if
# root), drop to the sandbox user, lower the limits, then replace itself by the real program, so the program starts
# as a clean interpreter under them. (Not preexec_fn: it is unsafe when the parent has threads, and it runs after
# Popen's own uid switch, too late to create a namespace.) A step that fails writes "step: reason" to the status
# pipe (close-on-exec, so the program never holds it) and exits without running the program.
_BOOTSTRAP = """\
import os, resource, sys
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
status, network, uid, gid, *limits, program = sys.argv[1:]
status, uid, gid = int(status), int(uid), int(gid)
os.set_inheritable(status, False)

def stop(step, reason):
    os.write(status, f"{step}: {reason}".encode())
    os._exit(125)

def unshare(flags):
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(flags)
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))

def isolate(flags, name, failures):
    try:
        unshare(flags)
        return True
    except OSError as exc:
        failures.append(f"{name}: {exc.strerror or exc}")
        return False

failures = []
isolated = network == "allow" or isolate(CLONE_NEWNET, "unshare(CLONE_NEWNET)", failures)
if uid >= 0:
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    except OSError as exc:
        stop("user", f"cannot switch to uid {uid} / gid {gid}: {exc}")
if not isolated and not isolate(CLONE_NEWUSER | CLONE_NEWNET, "unshare(CLONE_NEWUSER | CLONE_NEWNET)", failures):
    stop("network", "; ".join(failures))
for spec in limits:
    name, soft, hard = spec.split(":")
    kind = getattr(resource, name)
    soft, hard = int(soft), int(hard)
    current_hard = resource.getrlimit(kind)[1]
    if current_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(kind, (soft, hard))
try:
    os.execv(sys.executable, [sys.executable, "-I", "-X", "utf8", program])
except OSError as exc:
    stop("exec", exc)
"""


class SandboxConfig(BaseModel):
    """Limits of one sandboxed run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float = Field(
        default=10.0, gt=0, description="Wall-clock limit; the whole process group is killed after it."
    )
    cpu_time_s: int = Field(default=10, ge=1, description="RLIMIT_CPU: CPU seconds of each process.")
    memory_bytes: int = Field(default=1024 * MiB, ge=32 * MiB, description="RLIMIT_AS: address space of each process.")
    max_processes: int = Field(
        default=64,
        ge=1,
        description="RLIMIT_NPROC: processes and threads of the sandbox user (all of them, machine-wide).",
    )
    max_file_bytes: int = Field(default=16 * MiB, ge=0, description="RLIMIT_FSIZE: largest file the program may write.")
    max_open_files: int = Field(default=256, ge=16, description="RLIMIT_NOFILE: file descriptors of each process.")
    max_output_bytes: int = Field(
        default=64 * 1024, ge=1, description="Bytes of stdout, and of stderr, kept; the rest dropped."
    )
    python_executable: str | None = Field(
        default=None,
        description="Interpreter to run; default: the system python3 (found on /usr/local/bin:/usr/bin:/bin).",
    )
    drop_privileges: bool = Field(default=True, description="When running as root, run the child as sandbox_uid/gid.")
    sandbox_uid: int = Field(
        default=SANDBOX_UID, ge=1, description="The unprivileged user the child runs as (root only)."
    )
    sandbox_gid: int = Field(
        default=SANDBOX_GID, ge=1, description="The unprivileged group the child runs as (root only)."
    )
    extra_env: dict[str, str] = Field(default_factory=dict, description="Variables added to the scrubbed environment.")
    work_root: str | None = Field(
        default=None, description="Where temporary run directories go; default: the system temp dir."
    )
    allow_network: bool = Field(
        default=False,
        description="Run programs with the host's network (no network namespace). Off by default: where no "
        "namespace can be created, programs are refused rather than run with network access.",
    )

    @property
    def switches_user(self) -> bool:
        """Whether runs change uid: only root can, and only root needs to (for RLIMIT_NPROC to bind)."""
        return self.drop_privileges and os.geteuid() == 0

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """``RLIMIT_*`` name → (soft, hard). The CPU hard limit is a second above the soft one: SIGXCPU, then KILL."""
        return {
            "RLIMIT_CPU": (self.cpu_time_s, self.cpu_time_s + 1),
            "RLIMIT_AS": (self.memory_bytes, self.memory_bytes),
            "RLIMIT_NPROC": (self.max_processes, self.max_processes),
            "RLIMIT_FSIZE": (self.max_file_bytes, self.max_file_bytes),
            "RLIMIT_NOFILE": (self.max_open_files, self.max_open_files),
            "RLIMIT_CORE": (0, 0),
        }


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start programs at all (no usable interpreter, unusable work directory)."""


class NetworkIsolationUnavailable(SandboxUnavailable):
    """No network namespace can be created here, so programs are not run (``SandboxConfig.allow_network``)."""


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed program did. ``returncode`` is negative when a signal ended it (``-9``: SIGKILL)."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    stdout_bytes: int
    """Bytes the program wrote to stdout, including those dropped beyond ``max_output_bytes``."""
    stderr_bytes: int
    elapsed_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def signal_name(self) -> str | None:
        if self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    @property
    def error_line(self) -> str:
        """The last non-empty line of stderr: for an uncaught exception, ``TypeName: message``."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""


def run_python(
    code: str,
    config: SandboxConfig | None = None,
    stdin: str | bytes | None = None,
    files: Mapping[str, str | bytes] | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandbox; ``files`` are written next to it (relative paths).

    Raises `SandboxUnavailable` when the sandbox itself cannot run (a configuration problem) and `ValueError` for
    unusable ``files`` paths; whatever the program does is reported in the result.
    """
    config = config or SandboxConfig()
    if files and PROGRAM_NAME in files:
        raise ValueError(f"{PROGRAM_NAME!r} is the program itself; give the other files other names")
    python = resolve_python(config)
    workdir = _make_workdir(config)
    try:
        _write_files(workdir, {PROGRAM_NAME: code, **dict(files or {})}, config)
        with _stdin_file(stdin) as stdin_handle:
            return _run(python, workdir, stdin_handle, config)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # as root this removes whatever the program left there


def resolve_python(config: SandboxConfig) -> str:
    """The interpreter runs will use."""
    if config.python_executable:
        return config.python_executable
    found = shutil.which("python3", path=SYSTEM_PATH)
    if found:
        return found
    if not config.switches_user:
        return sys.executable
    raise SandboxUnavailable(
        f"no python3 on {SYSTEM_PATH}; set SandboxConfig.python_executable to an interpreter that uid "
        f"{config.sandbox_uid} can execute"
    )


def _make_workdir(config: SandboxConfig) -> str:
    try:
        workdir = tempfile.mkdtemp(prefix="longstraw-sandbox-", dir=config.work_root)
        if config.switches_user:
            os.chown(workdir, config.sandbox_uid, config.sandbox_gid)
    except OSError as exc:
        where = config.work_root or tempfile.gettempdir()
        raise SandboxUnavailable(f"cannot prepare a sandbox directory under {where}: {exc}") from exc
    return workdir


def _write_files(workdir: str, files: Mapping[str, str | bytes], config: SandboxConfig) -> None:
    for relative, content in files.items():
        path = PurePosixPath(relative)
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise ValueError(f"sandbox file paths must be relative and stay inside the sandbox, got {relative!r}")
        target = os.path.join(workdir, *path.parts)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(content.encode() if isinstance(content, str) else content)
        if config.switches_user:
            for created in _created_paths(workdir, path):
                os.chown(created, config.sandbox_uid, config.sandbox_gid)


def _created_paths(workdir: str, path: PurePosixPath) -> list[str]:
    return [os.path.join(workdir, *path.parts[: i + 1]) for i in range(len(path.parts))]


class _stdin_file:
    """The program's stdin: a temporary file (no pipe to feed, so no deadlock), or /dev/null."""

    def __init__(self, data: str | bytes | None) -> None:
        self._data = data
        self._file: IO[bytes] | None = None

    def __enter__(self) -> IO[bytes] | int:
        if self._data is None:
            return subprocess.DEVNULL
        self._file = tempfile.TemporaryFile()
        self._file.write(self._data.encode() if isinstance(self._data, str) else self._data)
        self._file.seek(0)
        return self._file

    def __exit__(self, *exc_info: object) -> None:
        if self._file is not None:
            self._file.close()


def _environment(workdir: str, config: SandboxConfig) -> dict[str, str]:
    base = {"PATH": SYSTEM_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    return {**base, **config.extra_env}


def _command(python: str, config: SandboxConfig, status_fd: int) -> list[str]:
    """The bootstrap's command line: status pipe, network mode, uid and gid (-1: keep), limits, program."""
    limits = [f"{name}:{soft}:{hard}" for name, (soft, hard) in config.rlimits().items()]
    network = "allow" if config.allow_network else "isolate"
    uid, gid = (config.sandbox_uid, config.sandbox_gid) if config.switches_user else (-1, -1)
    return [python, "-I", "-S", "-c", _BOOTSTRAP, str(status_fd), network, str(uid), str(gid), *limits, PROGRAM_NAME]


def _run(python: str, workdir: str, stdin: IO[bytes] | int, config: SandboxConfig) -> SandboxResult:
    start = time.monotonic()
    status_read, status_write = os.pipe()
    try:
        try:
            process = subprocess.Popen(
                _command(python, config, status_write),
                cwd=workdir,
                env=_environment(workdir, config),
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(status_write,),
            )
        except OSError as exc:
            raise _unavailable("exec", str(exc), python, config) from exc
        finally:
            os.close(status_write)  # the child holds the only write end: EOF once it runs the program or exits
        try:
            stdout, stderr, timed_out = _collect(process, start + config.timeout_s, config.max_output_bytes)
        finally:
            _kill_group(process)
            process.wait()
        _raise_if_not_started(status_read, python, config)
    finally:
        os.close(status_read)
    return SandboxResult(
        stdout=stdout.text(),
        stderr=stderr.text(),
        returncode=process.returncode,
        timed_out=timed_out,
        stdout_bytes=stdout.total,
        stderr_bytes=stderr.total,
        elapsed_s=time.monotonic() - start,
        stdout_truncated=stdout.truncated,
        stderr_truncated=stderr.truncated,
    )


def _raise_if_not_started(status_read: int, python: str, config: SandboxConfig) -> None:
    """Raise when the bootstrap stopped before the program (its reason is on the status pipe, else it is empty)."""
    report = os.read(status_read, 4096).decode(errors="replace")
    if report:
        step, _, reason = report.partition(": ")
        raise _unavailable(step, reason, python, config)


def _unavailable(step: str, reason: str, python: str, config: SandboxConfig) -> SandboxUnavailable:
    """The error for a run that could not start the program, saying how to fix it."""
    if step == "network":
        return NetworkIsolationUnavailable(
            f"the sandbox cannot create a network namespace here ({reason}), so the program was not run: it would "
            "have had network access. Run as root (CAP_SYS_ADMIN) or where unprivileged user namespaces are "
            "allowed, or set SandboxConfig(allow_network=True) to run programs with the host's network"
        )
    if step == "user":
        return SandboxUnavailable(
            f"{reason}: switching users needs CAP_SETUID and CAP_SETGID (SandboxConfig(drop_privileges=False) keeps "
            "the current user, and then RLIMIT_NPROC does not bind for root)"
        )
    who = f"uid {config.sandbox_uid}" if config.switches_user else "the current user"
    return SandboxUnavailable(
        f"cannot start {python} as {who}: {reason}. The interpreter must be executable by that user "
        "(a Python installed under /root is not); set SandboxConfig.python_executable"
    )


class _CappedBuffer:
    """Keeps the first ``cap`` bytes of a stream and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        room = self.cap - len(self.kept)
        if room > 0:
            self.kept += data[:room]
        self.total += len(data)

    @property
    def truncated(self) -> bool:
        return self.total > len(self.kept)

    def text(self) -> str:
        # when cut, a character split by the cut is dropped rather than shown as U+FFFD
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return decoder.decode(bytes(self.kept), final=not self.truncated)


def _collect(process: subprocess.Popen[bytes], deadline: float, cap: int) -> tuple[_CappedBuffer, _CappedBuffer, bool]:
    """Read both pipes until they close; kill the group at ``deadline`` or when the main process has exited."""
    assert process.stdout is not None and process.stderr is not None
    buffers = {"stdout": _CappedBuffer(cap), "stderr": _CappedBuffer(cap)}
    timed_out = False
    stop_reading_at: float | None = None  # set once the group is killed: drain what is buffered, then stop
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ, "stdout")
        selector.register(process.stderr, selectors.EVENT_READ, "stderr")
        while selector.get_map():
            now = time.monotonic()
            if stop_reading_at is None and (now >= deadline or _has_exited(process)):
                timed_out = not _has_exited(process)
                _kill_group(process)
                stop_reading_at = now + _DRAIN_GRACE_S
            if stop_reading_at is not None and now >= stop_reading_at:
                break
            horizon = deadline if stop_reading_at is None else stop_reading_at
            for key, _ in selector.select(timeout=max(0.0, min(_POLL_S, horizon - now))):
                data = os.read(key.fd, _CHUNK_BYTES)
                if data:
                    buffers[key.data].add(data)
                else:
                    selector.unregister(key.fileobj)
    process.stdout.close()
    process.stderr.close()
    return buffers["stdout"], buffers["stderr"], timed_out


def _has_exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether the main process has exited, without reaping it: while it is a zombie its pid (the group id) cannot
    be reused, so killing the group afterwards cannot hit an unrelated process."""
    return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass
