"""A throwaway Slurm cluster on this machine for tests: ``munged``, ``slurmctld`` and one
``slurmd`` per node name (``slurmd -N NAME``, its own port, every node at 127.0.0.1), all started
in the foreground as this process's children with a config in a temporary directory.

No cgroups: ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``. Auth is munge with a
freshly generated key and its own socket. Daemons listen on free ports; traffic stays on
loopback. :meth:`SlurmCluster.stop` ends exactly the processes it started.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from areal_mega.common.net import free_ports

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")


def missing_binaries() -> list:
    """The Slurm/munge programs this machine lacks (empty when a cluster can start)."""
    return [b for b in BINARIES if shutil.which(b) is None]


def slurm_version() -> str:
    """``slurm-wlm 22.05.8``-style version of the installed ``slurmd``."""
    return subprocess.run(["slurmd", "-V"], capture_output=True, text=True).stdout.strip()


def real_memory_mb() -> int:
    """This machine's memory as ``slurmd -C`` reports it (RealMemory must not exceed it)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True).stdout
    m = re.search(r"RealMemory=(\d+)", out)
    return int(m.group(1)) if m else 1000


def poll(cond, timeout_s: float, what: str, interval_s: float = 0.5):
    """Call ``cond()`` until it returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(interval_s)


class SlurmCluster:
    """Start with :meth:`start`, always :meth:`stop` (a context manager does both)."""

    def __init__(self, root: Path, nodes=("n1",), cpus: int = 2):
        self.root = Path(root)
        self.nodes = list(nodes)
        self.cpus = cpus
        self.procs: list = []
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Write the key and config, start the daemons, wait until every node is idle."""
        munge = self.root / "munge"
        for d in (
            munge,
            self.root / "state",
            self.root / "log",
            *(self.root / "spool" / n for n in self.nodes),
        ):
            d.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = munge / "socket"
        self._spawn(
            "munged",
            [
                "munged",
                "-F",
                "-f",
                f"--key-file={key}",
                f"--socket={sock}",
                f"--pid-file={munge / 'pid'}",
                f"--log-file={munge / 'log'}",
                f"--seed-file={munge / 'seed'}",
            ],
        )
        poll(sock.exists, 30, "munged socket")
        ports = free_ports(1 + len(self.nodes))
        self.conf.write_text(self._config(sock, ports[0], ports[1:]))
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        poll(self._all_idle, 90, f"Slurm nodes {self.nodes} idle")

    def _config(self, sock: Path, ctld_port: int, node_ports: list) -> str:
        r = self.root
        lines = [
            "ClusterName=areal-test",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={sock}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=10",
            "MinJobAge=3600",
            "InactiveLimit=0",
        ]
        mem = real_memory_mb()
        for n, port in zip(self.nodes, node_ports):
            lines.append(
                f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus} RealMemory={mem} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP"
        )
        return "\n".join(lines) + "\n"

    def _spawn(self, name: str, argv: list) -> None:
        log = open(self.root / "log" / f"{name}.stderr", "ab")
        self.procs.append(
            (name, subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        )
        log.close()

    def _all_idle(self) -> bool:
        for name, p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {p.returncode}; see {self.root / 'log'}\n{self.logs()}"
                )
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(x.split() for x in r.stdout.splitlines() if x.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def stop(self) -> None:
        """SIGTERM each daemon this cluster started (slurmd first), SIGKILL after 20 s."""
        for _name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=20)
        self.procs = []

    # ---------------------------------------------------------------- jobs
    def run(self, argv: list, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        kw.setdefault("env", self.env)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} -> {r.returncode}: {r.stdout}{r.stderr}")
        return r

    def sbatch(self, argv: list, env: dict, cwd: Path) -> int:
        """Submit (``argv`` starts with ``sbatch`` or a wrapper printing the job id); job id."""
        r = self.run(argv, env={**env, "SLURM_CONF": str(self.conf)}, cwd=cwd)
        return int(r.stdout.strip().split(";")[0].splitlines()[-1])

    def job(self, job_id: int) -> dict:
        """``scontrol show job`` fields of ``job_id``."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: int, timeout_s: float) -> dict:
        """Poll until the job has ended; its fields."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        return poll(
            lambda: (lambda j: j if j["JobState"] in ended else None)(self.job(job_id)),
            timeout_s,
            f"job {job_id} finished",
            interval_s=1.0,
        )

    def logs(self) -> str:
        """The tail of every daemon log (for assertion messages)."""
        out = []
        for f in sorted((self.root / "log").glob("*")):
            out.append(
                f"== {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:])
            )
        return "\n".join(out)


def job_processes(job_id: int) -> list:
    """``(pid, cmdline)`` of every live process whose environment carries this job id."""
    found = []
    needle = f"SLURM_JOB_ID={job_id}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if needle in env and state != "Z":
                found.append(
                    (
                        int(d.name),
                        (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"),
                    )
                )
        except OSError:
            continue
    return found
