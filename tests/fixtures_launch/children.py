"""Child processes for supervisor tests: ``python children.py MODE [ARG]``.

sleep        sleep forever
exit N       sleep 0.3 s, exit with code N
stubborn     ignore SIGTERM, sleep forever
listen PORT  listen on PORT and sleep forever
spawn DIR    start a grandchild in a NEW session (escapes the process group), write both pids
flaky FILE   exit 1 the first time (creating FILE), exit 0 afterwards
hang_once F  sleep forever the first time (creating F), exit 0 afterwards (a torchrun agent
             whose peer died: it never ends by itself)
flaky_after FILE OTHER  as flaky, but the first time only once OTHER exists (a peer is up)
orphan DIR   first time: start a grandchild in the same process group, write its pid to
             DIR/orphan, then SIGKILL itself (the grandchild survives it); afterwards exit 0
worker DIR   as torchrun: first time start a worker in a NEW session and exit 1 when it dies;
             the worker lives 3 s, forks a grandchild into its session, writes its pid to
             DIR/forked and SIGKILLs itself at once (the grandchild survives it, reparented to
             init: no longer anyone's descendant); afterwards exit 0
"""

import os
import signal
import socket
import subprocess
import sys
import time

mode = sys.argv[1]
arg = sys.argv[2] if len(sys.argv) > 2 else None
if mode == "sleep":
    time.sleep(3600)
elif mode == "exit":
    time.sleep(0.3)
    sys.exit(int(arg))
elif mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring SIGTERM", flush=True)
    time.sleep(3600)
elif mode == "listen":
    s = socket.socket()
    s.bind(("127.0.0.1", int(arg)))
    s.listen()
    time.sleep(3600)
elif mode == "spawn":
    g = subprocess.Popen([sys.executable, __file__, "sleep"], start_new_session=True)
    with open(os.path.join(arg, "pids"), "w") as f:
        f.write(f"{os.getpid()} {g.pid}")
    time.sleep(3600)
elif mode == "flaky":
    if not os.path.exists(arg):
        open(arg, "w").close()
        sys.exit(1)
    sys.exit(0)
elif mode == "flaky_after":
    if not os.path.exists(arg):
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.02)
        open(arg, "w").close()
        sys.exit(1)
    sys.exit(0)
elif mode == "hang_once":
    if not os.path.exists(arg):
        open(arg, "w").close()
        time.sleep(3600)
    sys.exit(0)
elif mode == "orphan":
    marker = os.path.join(arg, "orphan")
    if os.path.exists(marker):
        sys.exit(0)
    g = subprocess.Popen([sys.executable, __file__, "sleep"])
    with open(marker + ".tmp", "w") as f:
        f.write(str(g.pid))
    os.replace(marker + ".tmp", marker)
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "worker":
    marker = os.path.join(arg, "forked")
    if os.path.exists(marker):
        sys.exit(0)
    w = subprocess.Popen([sys.executable, __file__, "worker-body", arg], start_new_session=True)
    w.wait()
    sys.exit(1)
elif mode == "worker-body":
    time.sleep(3.0)  # longer than the supervisor's 2 s scan of descendants
    g = subprocess.Popen([sys.executable, __file__, "sleep"])
    marker = os.path.join(arg, "forked")
    with open(marker + ".tmp", "w") as f:
        f.write(str(g.pid))
    os.replace(marker + ".tmp", marker)
    os.kill(os.getpid(), signal.SIGKILL)
