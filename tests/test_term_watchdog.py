"""SIGTERM reaches a process whose main thread is stuck (common.signals.TermWatchdog): real
processes, real signals."""

import signal
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import sys, threading
    from areal_mega.common.signals import TermWatchdog
    stop = threading.Event()
    TermWatchdog(stop.set, exit_after_s=float(sys.argv[2])).install()
    print("ready", flush=True)
    if sys.argv[1] == "stuck":          # the main thread never runs Python again
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    else:                               # a healthy main thread stops on the event
        stop.wait()
        print("stopped cleanly", flush=True)
""")


def _start(mode: str, exit_after_s: float) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, mode, str(exit_after_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_stuck_main_thread_still_exits_on_sigterm_with_its_stack_dumped():
    p = _start("stuck", 0.5)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "did not stop 0.5s after signal 15" in err
    line = _CHILD.splitlines().index("    lock.acquire()") + 1  # the second one: it hangs
    assert f'File "<string>", line {line + 1} in <module>' in err


@pytest.mark.parametrize("signals", [1, 2])
def test_a_healthy_process_stops_through_on_term_without_the_hard_exit(signals):
    p = _start("healthy", 60.0)
    for _ in range(signals):  # the launcher may signal the process group and the pid
        p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "stopped cleanly" in out
    assert "term-watchdog" not in err


def test_a_late_sigterm_during_shutdown_is_ignored():
    """CPython puts Python-level handlers back to SIG_DFL at shutdown: a second SIGTERM arriving
    while a cleanly stopped process finalizes would kill it (-15). From the first exit handler on
    the watched signals are ignored (an exit handler registered before ``install`` runs after)."""
    child = textwrap.dedent("""
        import atexit, signal
        from areal_mega.common.signals import TermWatchdog
        atexit.register(lambda: print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN))
        TermWatchdog(exit_after_s=60.0).install()
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)
    """)
    out = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out == ["False", "True"], out
