"""A real local shardserve cluster for the tests: one coordinator_main and R groups of W
worker_main processes on loopback (worker number ``group * W + rank``), ports chosen by the servers (``--listen=127.0.0.1:0``) and read from port
files, as client/local_cluster.cc starts them. Every process is killed when the cluster stops.

The server binaries come from ``$SHARDSERVE_SERVER_DIR`` (the Bazel test sets it to its
runfiles), or the workspace's ``.bazel/bin/server``.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import List, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))


def server_dir() -> str:
    candidates = [os.environ.get("SHARDSERVE_SERVER_DIR", ""),
                  os.path.join(_HERE, "..", "..", ".bazel", "bin", "server")]
    for d in candidates:
        if d and all(os.access(os.path.join(d, b), os.X_OK)
                     for b in ("coordinator_main", "worker_main")):
            return os.path.abspath(d)
    raise RuntimeError("coordinator_main / worker_main not found: set SHARDSERVE_SERVER_DIR "
                       "or build //server:coordinator_main //server:worker_main")


class LocalCluster:
    """coordinator + ``groups`` x ``world`` workers; ``address`` is the coordinator's
    ``host:port``."""

    def __init__(self, world: int = 2, worker_flags: Optional[List[str]] = None,
                 groups: int = 1, tls: bool = False) -> None:
        self.world = world
        self.groups = groups
        self.bin = server_dir()
        self.work = tempfile.mkdtemp(prefix="shardserve-pytest-")
        self.worker_flags = list(worker_flags or [])
        # With tls: mTLS and roles on every port, certificates by deploy/make_certs.sh in
        # ``certs`` (ca.pem, client.pem / client.key with the roles read, write, admin).
        self.certs = os.path.join(self.work, "certs") if tls else ""
        if tls:
            subprocess.run([os.path.join(self.bin, "make_certs"), self.certs], check=True,
                           stdout=subprocess.DEVNULL)
        self.coordinator: Optional[subprocess.Popen] = None
        self.workers: List[Optional[subprocess.Popen]] = [None] * (world * groups)
        self.worker_ports: List[int] = [0] * (world * groups)
        try:
            self._start_coordinator()
            for worker in range(world * groups):
                self.start_worker(worker)
            self.wait_until_groups_serve()
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: List[str]) -> subprocess.Popen:
        log = open(os.path.join(self.work, name + ".log"), "ab")
        try:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def _wait_port(self, path: str, proc: subprocess.Popen, name: str) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    text = f.read().strip()
                if text and int(text) > 0:
                    return int(text)
            except (OSError, ValueError):
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}) before serving: "
                                   f"{self.log(name)[-2000:]}")
            time.sleep(0.01)
        raise RuntimeError(f"{name}: no port in {path} after 30 s")

    def log(self, name: str) -> str:
        try:
            with open(os.path.join(self.work, name + ".log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _start_coordinator(self) -> None:
        port_file = os.path.join(self.work, "coordinator.port")
        state = os.path.join(self.work, "state")
        os.makedirs(state, exist_ok=True)
        self.coordinator = self._spawn("coordinator", [
            os.path.join(self.bin, "coordinator_main"), "--listen=127.0.0.1:0",
            f"--port_file={port_file}", f"--world_size={self.world}", f"--groups={self.groups}",
            f"--state_dir={state}", *self._tls_flags("coordinator")])
        self.port = self._wait_port(port_file, self.coordinator, "coordinator")
        self.address = f"127.0.0.1:{self.port}"

    def start_worker(self, worker: int) -> None:
        port_file = os.path.join(self.work, f"worker{worker}.port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        proc = self._spawn(f"worker{worker}", [
            os.path.join(self.bin, "worker_main"), f"--coordinator={self.address}",
            f"--group={worker // self.world}", f"--rank={worker % self.world}",
            "--listen=127.0.0.1:0", f"--port_file={port_file}", "--drain_s=0",
            *self._tls_flags("worker"), *self.worker_flags])
        self.workers[worker] = proc
        self.worker_ports[worker] = self._wait_port(port_file, proc, f"worker{worker}")

    def wait_until_groups_serve(self, timeout: float = 30) -> None:
        """Until the coordinator reports every group serving: a table created before a group has
        formed waits only for the groups already formed (tests/cluster_fixture.cc waits so too)."""
        import shardserve
        from shardserve import _stubs

        serving = _stubs.load()[0].GROUP_STATE_SERVING
        tls = {}
        if self.certs:
            tls = {"tls_ca": os.path.join(self.certs, "ca.pem"),
                   "tls_cert": os.path.join(self.certs, "client.pem"),
                   "tls_key": os.path.join(self.certs, "client.key")}
        deadline = time.monotonic() + timeout
        with shardserve.Client(self.address, deadline=2, **tls) as c:
            while time.monotonic() < deadline:
                try:
                    groups = c.describe_cluster().groups
                    if len(groups) == self.groups and all(g.state == serving for g in groups):
                        return
                except shardserve.Error:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"the groups do not serve after {timeout} s: "
                           f"{self.log('coordinator')[-2000:]}")

    def _tls_flags(self, who: str) -> List[str]:
        if not self.certs:
            return []
        c = self.certs
        return [f"--tls_cert={c}/{who}.pem", f"--tls_key={c}/{who}.key", f"--tls_ca={c}/ca.pem",
                f"--tls_client_ca={c}/ca.pem", f"--tokens_file={c}/tokens", "--tls_reload_s=1"]

    def kill_worker(self, worker: int, sig: int = signal.SIGKILL) -> None:
        proc = self.workers[worker]
        if proc is not None:
            proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                proc.wait(10)
                self.workers[worker] = None

    def stop(self) -> None:
        procs = [p for p in self.workers + [self.coordinator] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                p.terminate()
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.workers = [None] * (self.world * self.groups)
        self.coordinator = None
        shutil.rmtree(self.work, ignore_errors=True)
