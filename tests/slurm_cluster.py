"""A throwaway one-node SLURM cluster on this machine, for tests/test_slurm.py.

Debian's slurm-wlm and munge (apt-get installs them when missing; needs root), one munged, slurmctld and
slurmd, no accounting database (as on many small clusters). slurm.conf is written to /etc/slurm/slurm.conf,
the one path that every SLURM command finds without help: the plugin's in-job `srun` runs with every
SLURM_* variable removed, SLURM_CONF included. State, spool, logs, the munge key and socket live in a temporary
folder. Only one such cluster runs at a time (a lock file); a slurm.conf this module did not write is never
touched. `LocalSlurm.stop()` cancels the jobs and ends the three daemons, by the ids in their pid files.
"""

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from conftest import snakemake

CONF = Path("/etc/slurm/slurm.conf")
MARK = "# Test cluster of cramswarm's tests/slurm_cluster.py (removed when the tests end)\n"
LOCK = Path("/tmp/cramswarm-slurm-test.lock")


class Unavailable(Exception):
    """SLURM cannot be installed or started here; the message says why (the tests skip with it)."""


def run(*cmd, timeout=30, check=True, env=None):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
    return proc


def install():
    """apt-get install slurm-wlm munge, unless the daemons are already there."""
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "munged", "sbatch")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Unavailable("SLURM is not installed, and installing it needs root and apt-get (Debian/Ubuntu)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        run("apt-get", "update", "-qq", timeout=300, env=env)
        run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge", timeout=600, env=env)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        raise Unavailable(f"apt-get install slurm-wlm munge failed: {getattr(err, 'stderr', '') or err}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_pidfile(path: Path, timeout=15.0):
    """SIGTERM the process named in a pid file, SIGKILL it if it is still there after `timeout` seconds."""
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


class LocalSlurm:
    """munged + slurmctld + slurmd on 127.0.0.1; `partition` is the default (and only) partition."""

    def __init__(self, folder: Path, partition: str = "test"):
        self.folder, self.partition = folder, partition
        self.node = socket.gethostname().split(".")[0]
        self._lock = None

    def start(self, timeout=60.0):
        if os.geteuid() != 0:
            raise Unavailable("a local SLURM cluster needs root (slurmd, /etc/slurm/slurm.conf)")
        install()
        self._lock = open(LOCK, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise Unavailable(f"another test session runs the local SLURM cluster ({LOCK} is locked)") from None
        try:
            if CONF.exists():
                if not CONF.read_text().startswith(MARK):
                    raise Unavailable(f"{CONF} exists and was not written by this test: not touching a real cluster")
                self._stop_daemons(CONF.read_text())  # left by a test session that was killed
            for sub in ("state", "spool", "log"):
                (self.folder / sub).mkdir(parents=True, exist_ok=True)
            key = self.folder / "munge.key"
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
            f = self.folder
            run("munged", "--force", f"--socket={f}/munge.sock", f"--key-file={key}", f"--pid-file={f}/munged.pid",
                f"--log-file={f}/log/munged.log", f"--seed-file={f}/munged.seed")
            CONF.parent.mkdir(parents=True, exist_ok=True)
            CONF.write_text(self._conf())
            run("slurmctld")
            run("slurmd", "-N", self.node)
            self._wait_idle(timeout)
        except (OSError, subprocess.SubprocessError, Unavailable) as err:
            logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.folder.glob("log/*.log")))
            self.stop()
            raise Unavailable(f"the local SLURM cluster did not come up: {err}{logs}") from None
        return self

    def _conf(self) -> str:
        # The node as slurmd sees it: real CPUs and memory ("NodeName=vm CPUs=2 ... RealMemory=24105").
        node = run("slurmd", "-C").stdout.splitlines()[0].split(maxsplit=1)[1]
        f = self.folder
        return MARK + f"""\
ClusterName=cramswarmtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={f}/munge.sock
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd.pid
SlurmctldLogFile={f}/log/slurmctld.log
SlurmdLogFile={f}/log/slurmd.log
# No cgroups in a container: track job processes through /proc, bind no tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# No accounting database: sacct knows no jobs, so the profile asks squeue, which shows a finished job for
# MinJobAge seconds.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
MpiDefault=none
ReturnToService=2
NodeName={self.node} NodeAddr=127.0.0.1 {node} State=UNKNOWN
PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""

    def _wait_idle(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = run("sinfo", "-h", "-n", self.node, "-o", "%T", check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise Unavailable(f"node {self.node} not idle after {timeout:.0f} s (sinfo: {state or 'no answer'})")

    def _stop_daemons(self, conf: str):
        pidfiles = {k: v for k, _, v in (line.partition("=") for line in conf.splitlines()) if k.endswith("PidFile")}
        for key in ("SlurmdPidFile", "SlurmctldPidFile"):
            if key in pidfiles:
                kill_pidfile(Path(pidfiles[key]))
        if "SlurmdPidFile" in pidfiles:
            kill_pidfile(Path(pidfiles["SlurmdPidFile"]).with_name("munged.pid"))

    def stop(self):
        """Cancel every job, wait for them to end, stop the daemons, remove slurm.conf."""
        if CONF.exists() and CONF.read_text().startswith(MARK):
            conf = CONF.read_text()
            run("scancel", "--partition", self.partition, check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and run("squeue", "-h", "-t", "R,CG", check=False).stdout.strip():
                time.sleep(0.5)  # until no job is running or completing
            self._stop_daemons(conf)
            CONF.unlink()
        else:
            kill_pidfile(self.folder / "munged.pid")
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # Queries the tests use.
    def jobs(self) -> list[dict]:
        """Every job slurmctld still knows (finished ones for MinJobAge): id, state, comment (the plugin writes
        the rule there), restarts, time_limit and tres (what was allocated) from `scontrol show job`."""
        out = run("squeue", "-h", "-t", "all", "-o", "%i|%T|%k").stdout
        jobs = [dict(zip(("id", "state", "comment"), line.split("|", 2))) for line in out.splitlines()]
        for job in jobs:
            fields = dict(re.findall(r"(\w+)=(\S*)", run("scontrol", "show", "job", job["id"]).stdout))
            job.update(restarts=int(fields["Restarts"]), time_limit=fields["TimeLimit"], tres=fields["TRES"])
        return jobs


def env(**values):
    """This environment without CRAMSWARM_SLURM_* variables, plus ``values``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CRAMSWARM_SLURM_")}
    return {**base, **values}


def planned_resources(work, *args, environ=None) -> dict[str, str]:
    """{rule: its 'resources:' line} of a dry run."""
    out = snakemake(work, "-n", *args, env=environ, timeout=300).stdout
    return dict(re.findall(r"^(?:local)?rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", out, re.M))
