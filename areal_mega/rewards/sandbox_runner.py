"""The process inside the code sandbox (run as ``python -I -S sandbox_runner.py WORKDIR``).

Launched by :mod:`areal_mega.rewards.sandbox`; never imported by the trainer. It reads
``WORKDIR/job.json`` (limits, tests) and ``WORKDIR/solution.py``, isolates itself, then runs
every test in a fresh forked child and writes one JSON line per test to its stdout
(``{"i", "ok", "s"}``, ``s`` = seconds from fork to reaping). Steps, in order (each namespace
step is best-effort; what worked is reported first as an ``{"isolation": {...}}`` line):

1. ``unshare`` new mount, network, IPC and PID namespaces (plus a user namespace when not
   root): the network namespace has only a down loopback, so no connection can be made;
2. in the mount namespace, every mount is made read-only (``mount_setattr`` recursive) except a
   bind mount of the working directory, so writes outside it fail with ``EROFS``;
3. fork: the child is PID 1 of the new PID namespace (when its harness exits, the kernel kills
   every process left in it, so a fork bomb cannot outlive the evaluation);
4. resource limits (address space, file size, process count, no core files), then, when root,
   drop to the slot's own unprivileged uid/gid (root is exempt from ``RLIMIT_NPROC``);
5. per test: fork, ``RLIMIT_CPU``, stdin from the test input, stdout to a file in the working
   directory, run the solution; the harness (not the solution) compares the output.
"""

import ctypes
import json
import math
import os
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
CLONE_NEWNET, CLONE_NEWIPC = 0x40000000, 0x08000000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY, AT_RECURSIVE, AT_FDCWD = 0x1, 0x8000, -100
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 share the new-syscall numbers


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _err(what):
    return f"{what}: {os.strerror(ctypes.get_errno())}"


def isolate(libc, workdir: str) -> dict:
    """Namespaces and read-only mounts (steps 1-2); returns what worked."""
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID
    if not root:
        flags |= CLONE_NEWUSER
    info = {"root": root, "netns": False, "pidns": False, "readonly": False, "why": []}
    if libc.unshare(flags) != 0:
        info["why"].append(_err("unshare"))
        return info
    info["netns"] = info["pidns"] = True
    if not root:  # map our own uid/gid into the new user namespace
        try:
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as e:
            info["why"].append(f"user namespace id maps: {e}")
            return info
    wd = workdir.encode()
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        info["why"].append(_err("mount --make-rprivate /"))
        return info
    if libc.mount(wd, wd, None, MS_BIND | MS_REC, None) != 0:
        info["why"].append(_err("bind mount of the working directory"))
        return info
    ro = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    rw = _MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0)
    if (
        libc.syscall(
            SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(ro), ctypes.sizeof(ro)
        )
        != 0
    ):
        info["why"].append(_err("mount_setattr / read-only"))
        return info
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, wd, 0, ctypes.byref(rw), ctypes.sizeof(rw)) != 0:
        info["why"].append(_err("mount_setattr workdir read-write"))
        return info
    info["readonly"] = True
    os.chdir(workdir)  # the old cwd still points into the now read-only mount
    return info


# Imported before the uid drop: the interpreter's files may not be readable by the slot uid
# (e.g. a Python installed under a private home directory); a forked test inherits them.
PRELOAD = (
    "array",
    "bisect",
    "collections",
    "copy",
    "datetime",
    "decimal",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "typing",
    "traceback",
    "io",
    "enum",
    "queue",
    "cmath",
    "socket",
    "encodings.idna",
    "struct",
    "textwrap",
    "hashlib",
    "time",
)


def limit_and_drop(job: dict) -> None:
    """Resource limits and, when root, the slot's unprivileged uid/gid (step 4)."""
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_AS, (job["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (job["max_file_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    nproc = job["max_procs"]
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    else:  # the limit counts every task of our uid (the trainer's too): allow those first
        nproc += _tasks_of_uid(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _tasks_of_uid(uid: int) -> int:
    """Processes and threads of ``uid`` now (what ``RLIMIT_NPROC`` counts)."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            n += int(fields.get("Threads", "1"))
    return n


def _tokens_equal(got: str, want: str) -> bool:
    a, b = got.split(), want.split()
    if a == b:
        return True
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


def _as_text(value) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _run_child(job: dict, src: str, i: int, report_fd: int) -> None:
    """In the forked test child: run the solution on test ``i``; never returns."""
    try:
        os.close(report_fd)  # the solution must not reach the result channel
        os.setpgid(0, 0)
        cpu = max(1, math.ceil(job["timeout_s"]))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        fn_name = job.get("fn_name")
        inp = job["inputs"][i]
        out_fd = os.open(f"out_{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        if fn_name is None:
            in_path = f"in_{i}"
            with open(in_path, "w") as f:
                f.write(_as_text(inp))
            in_fd = os.open(in_path, os.O_RDONLY)
            os.dup2(in_fd, 0)
            os.dup2(out_fd, 1)
            sys.stdin = open(0, "r", closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            exec(compile(src, "solution.py", "exec"), {"__name__": "__main__"})
            sys.stdout.flush()
        else:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            scope = {"__name__": "solution"}
            exec(compile(src, "solution.py", "exec"), scope)
            fn = scope.get(fn_name)
            if fn is None and "Solution" in scope:
                fn = getattr(scope["Solution"](), fn_name)
            args = inp if isinstance(inp, list) else [inp]
            result = fn(*args)
            os.write(out_fd, json.dumps(result).encode())
        os._exit(0)
    except SystemExit as e:
        try:
            sys.stdout.flush()
        except Exception:
            pass
        os._exit(0 if e.code in (None, 0) else 1)
    except BaseException:
        os._exit(1)


def _check(job: dict, i: int, status: int) -> bool:
    if status != 0:
        return False
    try:
        with open(f"out_{i}", "rb") as f:
            got = f.read(job["max_file_mb"] << 20).decode("utf-8", "replace")
    except OSError:
        return False
    want = job["outputs"][i]
    if job.get("fn_name") is None:
        return _tokens_equal(got, _as_text(want))
    try:
        result = json.loads(got)
    except ValueError:
        return False
    return result == want or [result] == want


def run_tests(job: dict, src: str, out) -> None:
    """Run every test in its own child, each under a wall deadline; report each result."""
    for i in range(len(job["inputs"])):
        pid = os.fork()
        if pid == 0:
            _run_child(job, src, i, out.fileno())
        started = time.monotonic()
        deadline = started + job["timeout_s"]
        status, delay, timed_out = None, 0.001, False
        while status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(raw)
            elif time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status, timed_out = -9, True
            else:
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        if os.getpid() == 1:  # PID 1 of our own namespace: clear anything the test left
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        ok = _check(job, i, status)
        # "t": killed at the wall deadline; "k": ended by a signal (deadline, CPU or memory limit)
        out.write(
            json.dumps(
                {
                    "i": i,
                    "ok": ok,
                    "s": round(time.monotonic() - started, 4),
                    "t": timed_out,
                    "k": status < 0,
                }
            )
            + "\n"
        )
        out.flush()
        if not ok and job.get("stop_at_first_failure"):
            return


def main() -> None:
    workdir = os.path.abspath(sys.argv[1])
    os.chdir(workdir)
    with open("job.json") as f:
        job = json.load(f)
    with open("solution.py") as f:
        src = f.read()
    out = os.fdopen(os.dup(1), "w")
    if job.get("namespaces", True):
        info = isolate(_libc(), workdir)
    else:
        info = {
            "root": os.geteuid() == 0,
            "netns": False,
            "pidns": False,
            "readonly": False,
            "why": ["namespaces turned off (CodeSandbox(namespaces=False))"],
        }
    out.write(json.dumps({"isolation": info}) + "\n")
    out.flush()
    pid = os.fork()  # with a PID namespace this child is its PID 1
    if pid == 0:
        try:
            limit_and_drop(job)
            run_tests(job, src, out)
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported, then exit
            out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
            code = 1
        out.flush()
        os._exit(code)
    _, raw = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(raw))


if __name__ == "__main__":
    main()
