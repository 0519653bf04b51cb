"""The subprocess sandbox (tools/sandbox.py) and the ``python`` tool on top of it (tools/python_tool.py).

Limits are small so that every run ends in well under a second (the timeout tests wait for their 1 s timeout);
bounds on elapsed time are 10x what a quiet machine takes, so a busy one does not fail them.
RLIMIT_NPROC counts every process of the sandbox user on the machine, so only the fork-bomb test sets it tight.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import stat
import subprocess
from pathlib import Path

import pytest
from paths import REPO

from longstraw_agents.tools import (
    NetworkIsolationUnavailable,
    SandboxConfig,
    SandboxUnavailable,
    ToolRegistry,
    make_python_tool,
    run_python,
)
from longstraw_agents.tools.sandbox import SANDBOX_UID

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="the uid switch (and what depends on it) happens only as root")

LIMITS = SandboxConfig(
    timeout_s=5,
    cpu_time_s=2,
    memory_bytes=256 * 2**20,
    max_processes=32,
    max_file_bytes=2**20,
    max_output_bytes=4096,
)


def run(code: str, **overrides: object) -> object:
    return run_python(code, LIMITS.model_copy(update=overrides))


def test_normal_output() -> None:
    result = run("import sys\nprint('hello', 6 * 7)\nprint('note', file=sys.stderr)")
    assert result.ok and (result.returncode, result.timed_out) == (0, False)
    assert (result.stdout, result.stderr) == ("hello 42\n", "note\n")
    assert not result.stdout_truncated and result.elapsed_s < 5


def test_stdin_and_files() -> None:
    code = "import sys\nsys.path.insert(0, '')\nfrom helper import double\nprint(double(int(sys.stdin.read())))"
    result = run_python(code, LIMITS, stdin="21", files={"helper.py": "def double(x):\n    return 2 * x\n"})
    assert result.stdout == "42\n", result.stderr


def test_exception_reports_the_last_traceback_line() -> None:
    result = run("def f():\n    raise KeyError('missing key')\nf()")
    assert not result.ok and result.returncode == 1
    assert result.error_line == "KeyError: 'missing key'"
    assert result.stderr.startswith("Traceback (most recent call last):")


def test_infinite_loop_times_out() -> None:
    result = run("while True:\n    pass", timeout_s=1, cpu_time_s=10)
    assert result.timed_out and not result.ok
    assert result.returncode == -signal.SIGKILL
    assert 1 <= result.elapsed_s < 10  # killed at its timeout (1 s), long before the CPU limit (10 s of CPU)


def test_cpu_limit_kills_a_busy_loop() -> None:
    result = run("while True:\n    pass", timeout_s=10, cpu_time_s=1)
    assert not result.timed_out
    assert result.returncode in (-signal.SIGXCPU, -signal.SIGKILL)


def test_memory_bomb_hits_the_address_space_limit() -> None:
    result = run("block = bytearray(2**30)")  # 1 GiB under a 256 MiB address-space limit
    assert not result.ok and result.error_line == "MemoryError"


@needs_root
def test_fork_bomb_is_refused_by_the_process_limit() -> None:
    code = (
        "import os, time\n"
        "print('uid', os.getuid(), os.getgid(), os.getgroups())\n"
        "children = 0\n"
        "for _ in range(20):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as exc:\n"
        "        print('refused', type(exc).__name__)\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(0.5)\n"
        "        os._exit(0)\n"
        "    children += 1\n"
        "print('children', children)\n"
    )
    result = run(code, max_processes=5)
    lines = result.stdout.splitlines()
    assert lines[0] == f"uid {SANDBOX_UID} {SANDBOX_UID} []"  # RLIMIT_NPROC binds only because we are not root
    assert lines[1] == "refused BlockingIOError"
    assert int(lines[2].split()[1]) < 5


def test_huge_file_hits_the_file_size_limit() -> None:
    code = "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (8 * 2**20))"
    result = run(code)
    assert not result.ok and result.error_line == "OSError: [Errno 27] File too large"


def test_ten_megabytes_of_output_are_capped() -> None:
    result = run("print('x' * 10_000_000)")
    assert result.ok and result.stdout_truncated
    assert result.stdout == "x" * LIMITS.max_output_bytes
    assert result.stdout_bytes == 10_000_001


def test_output_cap_does_not_split_a_character() -> None:
    result = run("print('é' * 100)", max_output_bytes=11)
    assert (result.stdout, result.stdout_truncated, result.stdout_bytes) == ("é" * 5, True, 201)


def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGSTRAW_TEST_SECRET", "hunter2")
    result = run("import os\nprint(sorted(os.environ))\nprint('hunter2' in repr(os.environ))")
    names, leaked = result.stdout.splitlines()
    assert "LONGSTRAW_TEST_SECRET" not in names and leaked == "False"
    assert run("import os; print(os.environ['HOME'] == os.getcwd())", extra_env={"EXTRA": "1"}).stdout == "True\n"


def test_cwd_is_a_fresh_temporary_directory() -> None:
    result = run("import os, sys\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nprint(sys.flags.isolated)")
    cwd, listing, isolated = result.stdout.splitlines()
    assert Path(cwd).name.startswith("longstraw-sandbox-") and not Path(cwd).is_relative_to(REPO)
    assert listing == "['main.py']" and isolated == "1"
    assert not Path(cwd).exists()  # removed after the run
    assert run("import os; print(os.getcwd())").stdout.strip() != cwd


@needs_root
def test_cannot_write_into_the_repository() -> None:
    probe = REPO / "sandbox-write-probe.txt"
    result = run(f"open({str(probe)!r}, 'w').write('owned')")
    assert result.error_line.startswith("PermissionError: [Errno 13] Permission denied")
    assert not probe.exists()


def test_background_children_die_with_the_program() -> None:
    code = (
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print('started')"
    )
    result = run(code)
    # the program returns at once (well under a second); waiting for the child would take 30 s
    assert result.ok and result.stdout == "started\n" and result.elapsed_s < 15


def test_bad_file_paths_are_refused() -> None:
    for path in ("../escape.py", "/etc/passwd", ""):
        with pytest.raises(ValueError, match="relative"):
            run_python("pass", LIMITS, files={path: "x"})
    with pytest.raises(ValueError, match="the program itself"):
        run_python("pass", LIMITS, files={"main.py": "x"})


@needs_root
def test_interpreter_the_sandbox_user_cannot_execute(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    interpreter = private / "python3"
    interpreter.symlink_to("/usr/bin/python3")
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    with pytest.raises(SandboxUnavailable, match="must be executable by that user"):
        run_python("print(1)", LIMITS.model_copy(update={"python_executable": str(interpreter)}))


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError):
        SandboxConfig(memory_bytes=1024)
    with pytest.raises(ValueError):
        SandboxConfig(unknown_limit=3)


# The python tool


@pytest.fixture(scope="module")
def python_tool():
    return make_python_tool(LIMITS.model_copy(update={"timeout_s": 1}), max_output_chars=2000)


def test_python_tool_output(python_tool) -> None:
    result = python_tool.invoke({"code": "print(sum(range(10)))"})
    assert (result.ok, result.content) == (True, "45")
    assert python_tool.invoke({"code": "x = 1"}).content == "(no output)"
    assert python_tool.schema["function"]["parameters"]["required"] == ["code"]


def test_python_tool_exception(python_tool) -> None:
    result = python_tool.invoke({"code": "print('before')\n1 / 0"})
    assert result.error == "exception" and not result.ok
    assert result.content.startswith("before\n[stderr]\nTraceback")
    assert result.content.endswith("Error: the program exited with status 1: ZeroDivisionError: division by zero")


def test_python_tool_timeout_keeps_partial_output(python_tool) -> None:
    result = python_tool.invoke({"code": "print('started', flush=True)\nwhile True:\n    pass"})
    assert result.error == "timeout"
    assert result.content == "started\nError: the program timed out after 1 s (wall clock) and was killed"


def test_python_tool_oversize_output(python_tool) -> None:
    result = python_tool.invoke({"code": "print('y' * 1_000_000)"})
    assert (result.error, result.truncated) == ("output_too_large", True)
    assert result.original_length == 1_000_001
    assert len(result.content) <= python_tool.max_output_chars
    assert result.content.startswith("yyy") and "…[truncated " in result.content


def test_python_tool_through_the_registry(python_tool) -> None:
    tools = ToolRegistry([python_tool])
    text = '<tool_call>{"name": "python", "arguments": {"code": "print(\\"\\\\u00e9t\\u00e9\\")"}}</tool_call>'
    [result] = tools.execute_text(text)
    assert result.content == "été"


# The network namespace

CONNECT = """\
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3).close()
    print("connected")
except OSError as exc:
    print("refused", exc.errno)
"""


@pytest.fixture
def listener():
    """A TCP listener on the test process's loopback (the host's network namespace)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        yield server


def connections(listener: socket.socket) -> int:
    """Connections the listener received (the kernel completes them before accept, so none is missed)."""
    count = 0
    while True:
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            return count
        connection.close()
        count += 1


def connect_code(listener: socket.socket) -> str:
    return CONNECT.format(port=listener.getsockname()[1])


def wrapper(tmp_path: Path, *launcher: str) -> str:
    """An interpreter path that runs the system python3 under ``launcher`` (a real way to change what the sandbox's
    bootstrap may do: drop a capability, or start in a user namespace)."""
    script = tmp_path / "python3"
    script.write_text(f'#!/bin/sh\nexec {" ".join(launcher)} /usr/bin/python3 "$@"\n')
    script.chmod(0o755)
    return str(script)


def works(*command: str) -> bool:
    return shutil.which(command[0]) is not None and subprocess.run(command, capture_output=True).returncode == 0


def test_sandboxed_code_cannot_reach_a_loopback_listener(listener: socket.socket) -> None:
    result = run(connect_code(listener))
    assert result.stdout == f"refused {errno.ENETUNREACH}\n", result.stderr  # loopback exists but is down
    assert connections(listener) == 0


def test_with_network_allowed_the_same_code_connects(listener: socket.socket) -> None:
    """The control: the check above fails when the namespace is not there."""
    assert run(connect_code(listener), allow_network=True).stdout == "connected\n"
    assert connections(listener) == 1


def test_the_namespace_has_only_a_loopback_interface() -> None:
    assert run("import socket\nprint(socket.if_nameindex())").stdout == "[(1, 'lo')]\n"


def test_the_status_pipe_does_not_reach_the_program() -> None:
    result = run("import os\nprint(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))")
    assert result.stdout == "[0, 1, 2, 3]\n"  # stdin, stdout, stderr and listdir's own descriptor


def test_a_program_cannot_fake_the_refusal() -> None:
    result = run("import os, sys\nsys.stderr.write('network: faked')\nsys.stderr.flush()\nos._exit(125)")
    assert result.returncode == 125 and result.stderr == "network: faked"


userns_fallback = pytest.mark.skipif(
    not (
        IS_ROOT and works("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "unshare", "-rn", "true")
    ),
    reason="needs root, setpriv and unprivileged user namespaces",
)


@userns_fallback
def test_without_cap_sys_admin_the_namespace_comes_from_a_user_namespace(
    tmp_path: Path, listener: socket.socket
) -> None:
    """Root without CAP_SYS_ADMIN (dropped from the bounding set) cannot unshare the network itself; after the switch
    to uid 65534 a user namespace gives the program its own network namespace all the same."""
    python = wrapper(tmp_path, "setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin")
    result = run(connect_code(listener) + "import os\nprint(os.getuid())", python_executable=python)
    assert result.stdout == f"refused {errno.ENETUNREACH}\n{SANDBOX_UID}\n", result.stderr
    assert connections(listener) == 0


no_namespace = pytest.mark.skipif(not works("unshare", "--user", "true"), reason="needs unshare(1) and user namespaces")


@no_namespace
def test_where_no_namespace_can_be_created_nothing_runs(tmp_path: Path, listener: socket.socket) -> None:
    """In a user namespace without a uid mapping the bootstrap has no capabilities and may not create a user
    namespace either: no network namespace is possible. The program is refused, not run with network access."""
    config = {"python_executable": wrapper(tmp_path, "unshare", "--user"), "drop_privileges": False}
    with pytest.raises(NetworkIsolationUnavailable, match=r"allow_network=True") as refused:
        run(connect_code(listener), **config)
    assert "unshare(CLONE_NEWNET): Operation not permitted" in str(refused.value)
    assert connections(listener) == 0
    assert run(connect_code(listener), **config, allow_network=True).stdout == "connected\n"  # the user's choice
    assert connections(listener) == 1


@no_namespace
def test_the_python_tool_refuses_where_no_namespace_can_be_created(tmp_path: Path, listener: socket.socket) -> None:
    config = LIMITS.model_copy(
        update={"python_executable": wrapper(tmp_path, "unshare", "--user"), "drop_privileges": False}
    )
    result = make_python_tool(config).invoke({"code": connect_code(listener)})
    assert result.error == "denied" and not result.ok
    assert result.content.startswith("Error: the python tool is disabled here") and "allow_network" in result.content
    assert connections(listener) == 0
    allowed = make_python_tool(config.model_copy(update={"allow_network": True}))
    assert allowed.invoke({"code": connect_code(listener)}).content == "connected"
