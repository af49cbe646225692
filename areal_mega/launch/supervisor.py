"""A generic process supervisor: start a list of process specs, watch them, stop them all.

    sup = Supervisor([ProcessSpec("server0", [...], ready=tcp_ready("127.0.0.1", 8000)),
                      ProcessSpec("trainer", [...], kind="main", restart=True)],
                     log_dir=run_dir / "logs", grace_s=10, max_restarts=3)
    rc = sup.run()

Behaviour:

- specs start in order; a spec with ``ready`` is polled until ready (or its timeout, or its
  death) before the next one starts.
- each child runs in its own session / process group with ``PR_SET_PDEATHSIG`` (Linux), its
  stdout+stderr appended to ``<log_dir>/<name>.log``.
- a ``service`` that exits (any code) ends the run with a failure, unless it has
  ``restart=True``: then it alone is relaunched (not waited for). A ``main`` spec that exits 0
  is done, and when every ``main`` is done the run ends with 0. A ``main`` spec with
  ``restart=True`` that fails is relaunched (with its ``restart_with_main`` companions, and
  the other mains of its ``gang``, stopped first, finished or not, in one relaunch). All
  relaunches share one budget, ``max_restarts`` in total; ``spec.on_restart(spec, attempt)``
  may return the argv of that relaunch (e.g. to resume), the spec's own argv is kept for later.
- ``spec.fatal(rc)`` returning a message marks a failure that a relaunch cannot cure (e.g. a
  full disk): the run ends at once with ``rc``.
- the supervisor's own log is best effort: a write that fails (a full disk) is reported once
  on stderr and the supervisor goes on (it still stops every process).
- SIGINT / SIGTERM to the supervisor stop everything (a second signal skips the grace period);
  ``run`` then returns ``128 + signum``.
- stopping: SIGTERM to each child's process group and to every descendant found with psutil,
  wait ``grace_s``, then SIGKILL what is left; every child is reaped.
- a spec with a ``launcher`` runs elsewhere (``launch.ray``: on a Ray node): the launcher
  starts it and returns a :class:`RemoteProcess`; everything above holds for it, the stopping
  is done by its host (:func:`stop_tree`, the same steps).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import psutil

from areal_mega.common.log_tail import last_error

_PR_SET_PDEATHSIG = 1
try:
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover
    _LIBC = None


def _child_setup() -> None:
    """Runs in the child between fork and exec: die with the supervisor (Linux)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ProcessSpec:
    """What to run. ``kind``: ``service`` (must stay up) or ``main`` (its exit 0 ends the run)."""

    name: str
    argv: list
    env: Optional[dict] = None  # added to the supervisor's environment
    cwd: Optional[str] = None
    kind: str = "service"
    restart: bool = False  # relaunch after a failure (see the module doc)
    ready: Optional[Callable[[], bool]] = None
    ready_timeout_s: float = 600.0
    on_restart: Optional[Callable[["ProcessSpec", int], Optional[list]]] = None
    restart_with_main: bool = False  # service: stopped and relaunched with a relaunched main
    fatal: Optional[Callable[[int], Optional[str]]] = None  # rc -> why no relaunch helps
    # start it elsewhere: launcher(spec, argv, env, log_path, attempt) -> a RemoteProcess
    launcher: Optional[Callable] = None
    # main: the mains of one gang (a trainer's torchrun agents on several nodes, whose static
    # rendezvous wants all of them at once) are stopped and relaunched together
    gang: Optional[str] = None

    def __post_init__(self):
        if self.kind not in ("service", "main"):
            raise ValueError(
                f"ProcessSpec {self.name!r}: kind={self.kind!r} must be 'service' or 'main'"
            )
        if not self.argv:
            raise ValueError(f"ProcessSpec {self.name!r}: empty argv")


@dataclass
class _Running:
    spec: ProcessSpec
    proc: subprocess.Popen
    log: object
    attempt: int = 0
    done: bool = False
    descendants: set = field(default_factory=set)
    group_cleared: bool = False  # what its process group left behind was stopped
    # process groups of descendants that lead their own (torchrun starts each worker in a new
    # session): a process such a worker forks after the last refresh is in one of them
    groups: set = field(default_factory=set)


class SupervisorError(RuntimeError):
    pass


class RemoteProcess:
    """What a :attr:`ProcessSpec.launcher` returns: a process on another host, with the part
    of :class:`subprocess.Popen` the supervisor uses (``pid``, ``returncode``, ``poll``,
    ``wait``) and ``terminate(grace_s)`` (its host stops the process tree: SIGTERM, SIGKILL
    after the grace period) and ``kill()``. ``lost`` says why it ended when its host went away
    (a node lost): then it is reported as that instead of an exit code."""

    pid: int = 0
    returncode: Optional[int] = None
    lost: Optional[str] = None

    def poll(self) -> Optional[int]:  # pragma: no cover - interface
        raise NotImplementedError

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"remote pid {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode

    def terminate(self, grace_s: float) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def kill(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def start_child(argv: list, env: dict, cwd: Optional[str], log) -> subprocess.Popen:
    """Start one supervised child: its own session, ``PR_SET_PDEATHSIG`` (it dies with the
    thread that started it: start it from one that lives as long as the supervisor), output
    appended to the open binary file ``log``."""
    return subprocess.Popen(
        [str(a) for a in argv],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_child_setup,
    )


def stop_tree(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM ``proc``'s process group and every descendant, SIGKILL what is left after
    ``grace_s``, reap ``proc`` (for a child started by :func:`start_child` on this host)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    groups = {proc.pid}
    for p in kids:
        try:
            groups.add(os.getpgid(p.pid))
        except OSError:
            pass
    for g in groups:
        if g != os.getpgrp():
            try:
                os.killpg(g, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    for p in kids:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_alive(p) for p in kids):
            break
        time.sleep(0.05)
    for g in groups:
        if g != os.getpgrp() and _group_members(g):
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in kids:
        if _alive(p):
            try:
                p.kill()
            except psutil.Error:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover (unkillable: D state)
        pass
    psutil.wait_procs(kids, timeout=5)


class Supervisor:
    def __init__(
        self,
        specs: list,
        log_dir: str | Path,
        grace_s: float = 10.0,
        max_restarts: int = 0,
        poll_s: float = 0.2,
        echo: Optional[Callable[[str], None]] = None,
    ):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate process names: {names}")
        self.specs = list(specs)
        self.log_dir = Path(log_dir)
        self.grace_s, self.max_restarts, self.poll_s = grace_s, max_restarts, poll_s
        self.restarts, self.running = 0, {}
        self._signal, self._signal_count = None, 0  # the last signal received, how many
        self._echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._sup_log = (self.log_dir / "supervisor.log").open("a", encoding="utf-8")
        self._log_error: Optional[OSError] = None
        self._calls: queue.Queue = queue.Queue()  # (fn, future) from other threads
        # relaunched services not ready yet: name -> monotonic time of the relaunch
        self.relaunching: dict = {}

    # ------------------------------------------------------------------ messages and signals

    def _log_failed(self, path, e: OSError) -> None:
        """Report a failed log write once, on stderr (the disk may be full)."""
        if self._log_error is None:
            self._log_error = e
            print(
                f"[supervisor] cannot write {path}: {e.strerror or e}; its messages go to "
                "stderr only",
                file=sys.stderr,
                flush=True,
            )

    def say(self, msg: str) -> None:
        """Log ``msg`` to ``supervisor.log`` (best effort) and echo it (stderr by default)."""
        line = f"[supervisor {time.strftime('%H:%M:%S')}] {msg}"
        if self._log_error is None:
            try:
                self._sup_log.write(line + "\n")
                self._sup_log.flush()
            except OSError as e:
                self._log_failed(self._sup_log.name, e)
        self._echo(line)

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum
        self._signal_count += 1

    # ------------------------------------------------------------------ processes

    def _launch(self, spec: ProcessSpec, attempt: int = 0, argv: Optional[list] = None) -> _Running:
        argv = list(argv or spec.argv)
        log = (self.log_dir / f"{spec.name}.log").open("ab")
        try:
            log.write(
                f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} start {spec.name} attempt "
                f"{attempt}: {' '.join(map(str, argv))}\n".encode()
            )
            log.flush()
        except OSError as e:
            self._log_failed(log.name, e)
        if spec.launcher is not None:  # its host adds the entries to its own environment
            env = {k: str(v) for k, v in (spec.env or {}).items()}
            try:
                proc = spec.launcher(spec, argv, env, Path(log.name), attempt)
            except Exception as e:  # noqa: BLE001 - no host for it: the run cannot go on
                _close_quietly(log)
                raise SupervisorError(f"cannot start {spec.name}: {e}") from None
            where = f" on {proc.where}" if getattr(proc, "where", None) else ""
            self.say(f"started {spec.name} pid {proc.pid}{where} (log {log.name})")
            run = _Running(spec, proc, log, attempt)
            self.running[spec.name] = run
            return run
        env = dict(os.environ)
        env.update({k: str(v) for k, v in (spec.env or {}).items()})
        proc = start_child(argv, env, spec.cwd, log)
        self.say(f"started {spec.name} pid {proc.pid} (log {log.name})")
        run = _Running(spec, proc, log, attempt)
        self.running[spec.name] = run
        return run

    def call(self, fn: Callable[["Supervisor"], object], timeout: float = 600.0):
        """Run ``fn(self)`` on the supervisor's loop (from another thread: e.g. launch.scale
        starting or retiring a server) and return its result; its exception is raised here."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        return fut.result(timeout)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn(self))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def add(self, spec: ProcessSpec) -> _Running:
        """Start one more process, watched like the others. Call on the loop (:meth:`call`)."""
        if spec.name in self.running:
            raise ValueError(f"a process named {spec.name!r} is already running")
        return self._launch(spec)

    def retire(self, name: str) -> None:
        """Stop the process ``name`` (SIGTERM, SIGKILL after the grace period) and forget it:
        its exit is no failure. Call on the loop (:meth:`call`)."""
        run = self.running.pop(name)
        self.relaunching.pop(name, None)
        self.stop_all(runs=[run])
        _close_quietly(run.log)
        self.say(f"{name} retired")

    def _refresh_descendants(self) -> None:
        for run in self.running.values():
            if isinstance(run.proc, RemoteProcess):
                continue  # its host finds them when it stops it
            if run.proc.poll() is None:
                try:
                    children = psutil.Process(run.proc.pid).children(recursive=True)
                except psutil.Error:
                    continue
                run.descendants |= {p.pid for p in children}
                for p in children:
                    try:
                        pgid = os.getpgid(p.pid)
                    except OSError:
                        continue
                    if pgid not in (run.proc.pid, os.getpgrp()):
                        run.groups.add(pgid)

    def _wait_ready(self, run: _Running) -> None:
        spec = run.spec
        deadline = time.monotonic() + spec.ready_timeout_s
        while True:
            if self._signal is not None:
                return
            if run.proc.poll() is not None:
                raise SupervisorError(
                    f"{spec.name} exited with code {run.proc.returncode} "
                    f"before it was ready; see {run.log.name}" + last_error(run.log.name)
                )
            try:
                if spec.ready():
                    self.say(f"{spec.name} is ready")
                    return
            except Exception:  # a readiness probe may raise while the server boots
                pass
            if time.monotonic() > deadline:
                raise SupervisorError(
                    f"{spec.name} not ready after {spec.ready_timeout_s:.0f}s; see {run.log.name}"
                )
            time.sleep(self.poll_s)

    def stop_all(self, grace_s: Optional[float] = None, runs: Optional[list] = None) -> None:
        """SIGTERM every process group and descendant (of ``runs``, default all), then SIGKILL
        after the grace period."""
        grace = self.grace_s if grace_s is None else grace_s
        runs = list(self.running.values()) if runs is None else runs
        self._refresh_descendants()
        targets: list = []
        for run in runs:
            if isinstance(run.proc, RemoteProcess):
                if run.proc.poll() is None:
                    run.proc.terminate(grace)
                continue
            pids = set(run.descendants)
            # A leader killed with SIGKILL leaves its group behind (e.g. a multiprocessing
            # manager the trainer spawned); its pgid stays valid while any member lives. Only
            # signal a dead leader's group once, right after its death was seen, so that a
            # recycled pid can never be hit.
            if run.proc.poll() is None or not run.group_cleared:
                pids.add(run.proc.pid)
                pids |= _group_members(run.proc.pid)
                try:
                    os.killpg(run.proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
            run.group_cleared = True
            # the descendants' own groups, each signalled once (a dead group's id is not reused
            # while any member lives; once empty it is dropped)
            for pgid in list(run.groups):
                members = _group_members(pgid)
                run.groups.discard(pgid)
                if members:
                    pids |= members
                    try:
                        os.killpg(pgid, signal.SIGTERM)
                    except (ProcessLookupError, PermissionError):
                        pass
            targets.extend(pids)
        procs = []
        for pid in set(targets):
            try:
                p = psutil.Process(pid)
                p.send_signal(signal.SIGTERM)
                procs.append(p)
            except psutil.Error:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self._signal_count > 1:  # a second Ctrl-C: no more waiting
                break
            for run in runs:
                run.proc.poll()
            if all(not _alive(p) for p in procs) and all(
                r.proc.returncode is not None for r in runs
            ):
                break
            time.sleep(0.05)
        for run in runs:
            if run.proc.poll() is None:
                self.say(f"{run.spec.name} ignored SIGTERM for {grace:.0f}s: SIGKILL")
                if isinstance(run.proc, RemoteProcess):
                    run.proc.kill()
                    continue
                try:
                    os.killpg(run.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in procs:
            if _alive(p):
                try:
                    p.kill()
                except psutil.Error:
                    pass
        for run in runs:
            try:
                run.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover (unkillable: D state)
                self.say(f"{run.spec.name} pid {run.proc.pid} did not die")
            _close_quietly(run.log)
        psutil.wait_procs(procs, timeout=5)

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        """Start, watch and stop; returns 0 on success, the failing exit code, or 128+signal."""
        in_main = threading.current_thread() is threading.main_thread()
        old = {}
        if in_main:
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, self._on_signal)
        try:
            return self._run()
        except SupervisorError as e:
            self.say(f"error: {e}")
            return 1
        finally:
            self.stop_all()
            self.say("all processes stopped")
            _close_quietly(self._sup_log)
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        for spec in self.specs:
            if self._signal is not None:
                break
            run = self._launch(spec)
            if spec.ready is not None:
                self._wait_ready(run)
        last_scan = 0.0
        while self._signal is None:
            self._run_calls()
            if time.monotonic() - last_scan > 2.0:
                self._refresh_descendants()
                last_scan = time.monotonic()
            for name, run in list(self.running.items()):
                if self.running.get(name) is not run:
                    continue  # relaunched in this pass, with a gang member or as a companion
                if run.done or run.proc.poll() is None:
                    continue
                rc = run.proc.returncode
                if run.spec.kind == "main" and rc == 0:
                    run.done = True
                    self.say(f"{name} finished")
                    self.stop_all(runs=[run])  # whatever it left running
                    continue
                why = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
                if getattr(run.proc, "lost", None):
                    why = run.proc.lost
                fatal = run.spec.fatal(rc) if run.spec.fatal is not None else None
                if fatal:
                    self.say(
                        f"{name} failed ({why}): {fatal}; not relaunching, stopping "
                        f"everything. Log: {run.log.name}"
                    )
                    return rc if rc > 0 else 128 - rc
                if (
                    run.spec.kind == "service"
                    and run.spec.restart
                    and self.restarts < self.max_restarts
                ):
                    self._relaunch_service(run, why)
                    continue
                if (
                    run.spec.kind == "main"
                    and run.spec.restart
                    and self.restarts < self.max_restarts
                ):
                    self.restarts += 1
                    self.say(f"{name} failed ({why}); relaunch {self.restarts}/{self.max_restarts}")
                    gang = [
                        r
                        for r in self.running.values()
                        if run.spec.gang and r.spec.gang == run.spec.gang and r is not run
                    ]
                    for r in [run] + gang:
                        _close_quietly(r.log)
                        if r.spec.on_restart is not None:
                            argv = r.spec.on_restart(r.spec, self.restarts)
                            if argv:
                                r.spec.argv = list(argv)
                    companions = [
                        r
                        for r in self.running.values()
                        if r.spec.restart_with_main and r is not run and r not in gang
                    ]
                    if gang:  # e.g. torchrun's other agents: their static rendezvous
                        self.say(
                            f"restarting its gang ({run.spec.gang}) with it: "
                            + ", ".join(r.spec.name for r in gang)
                        )
                    if companions:  # e.g. the rollout worker, whose sockets face the main
                        self.say(
                            "restarting with it: " + ", ".join(r.spec.name for r in companions)
                        )
                    # the failed main's leftovers go too: they may hold its ports and files
                    self.stop_all(runs=[run] + gang + companions)
                    for r in [run] + gang + companions:
                        self._launch(r.spec, self.restarts)
                    continue
                self.say(
                    f"{name} died ({why}); stopping everything. Log: {run.log.name}"
                    + last_error(run.log.name)
                )
                return rc if rc > 0 else 128 - rc
            mains = [r for r in self.running.values() if r.spec.kind == "main"]
            if mains and all(r.done for r in mains):
                self.say("run complete")
                return 0
            time.sleep(self.poll_s)
        self.say(f"received signal {self._signal}; stopping everything")
        return 128 + self._signal

    def _relaunch_service(self, run: _Running, why: str) -> None:
        """Relaunch a failed ``restart=True`` service alone (its readiness is not awaited: its
        clients wait for it), with the argv ``on_restart`` returns for this attempt."""
        self.restarts += 1
        name = run.spec.name
        self.say(f"{name} failed ({why}); relaunch {self.restarts}/{self.max_restarts} (service)")
        self.stop_all(runs=[run])  # whatever it left behind may hold its port
        argv = run.spec.on_restart(run.spec, self.restarts) if run.spec.on_restart else None
        new = self._launch(run.spec, self.restarts, argv=argv)
        if run.spec.ready is not None:
            since = self.relaunching[name] = time.monotonic()
            threading.Thread(
                target=self._watch_ready, args=(new, since), daemon=True, name=f"ready-{name}"
            ).start()

    def _watch_ready(self, run: _Running, since: float) -> None:
        """Poll a relaunched service's readiness off the loop until it is ready or gone."""
        name = run.spec.name
        while self.running.get(name) is run and run.proc.poll() is None and self._signal is None:
            try:
                ready = run.spec.ready()
            except Exception:  # noqa: BLE001 - a probe may raise while it boots
                ready = False
            if ready:
                self.say(f"{name} is ready again after {time.monotonic() - since:.1f}s")
                break
            time.sleep(0.5)
        if self.relaunching.get(name) == since:
            self.relaunching.pop(name, None)


def _close_quietly(f) -> None:
    """Close a log file whose last flush may fail (a full disk): the data is lost either way."""
    try:
        f.close()
    except OSError:
        pass


def _group_members(pgid: int) -> set:
    """Pids of the live processes in process group ``pgid``."""
    out = set()
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.add(p.pid)
        except OSError:
            pass
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
