"""HAProxy (Debian's 2.6) in front of gateway replicas, for the replicas' tests and bench: on
127.0.0.1, its listening socket bound here with a port from the kernel and handed to it
(`bind fd@N`, no free-port probing), round-robin over the replicas (or by rollout),
health-checking each
one's `/healthz`. A connection a dead replica refuses is tried on another replica; a call
in flight at a replica that dies fails at the balancer (502), as it would in production."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import httpx

from darl.deploy.processes import ManagedProcess, ProcessFailedError

# Health checks every 500 ms, down after 3 failures, each given 2 s (a replica on a busy
# machine answers /healthz slowly): a killed replica leaves the rotation within ~1.5 s, and
# a connection it refuses meanwhile is tried on another replica.
CHECK = "check inter 500ms fall 3 rise 1"


# Round-robin: one rollout's calls alternate replicas (what the tests need). By rollout: the
# first two path segments (/rollouts/<id>) hashed, so a rollout's calls stay on one replica
# until it leaves the rotation.
ROUND_ROBIN = "roundrobin"
BY_ROLLOUT = "uri depth 2\n  hash-type consistent"


def haproxy_config(
    listen_fd: int, replicas: list[str], stats_socket: Path, balance: str = ROUND_ROBIN
) -> str:
    servers = "".join(
        f"  server {name} {address.removeprefix('http://')} {CHECK}\n"
        for name, address in _named(replicas)
    )
    return f"""global
  maxconn 4000
  stats socket {stats_socket} mode 600 level admin

defaults
  mode http
  option http-keep-alive
  timeout connect 2s
  timeout check 2s
  timeout client 600s
  timeout server 600s
  timeout http-keep-alive 60s
  # A connection refused never reached a replica: try another (never a call that did).
  retries 3
  retry-on conn-failure
  option redispatch 1

frontend agents
  bind fd@{listen_fd}
  default_backend gateways

backend gateways
  balance {balance}
  option httpchk GET /healthz
{servers}"""


def _named(replicas: list[str]) -> list[tuple[str, str]]:
    return [(f"replica{i}", url.rstrip("/")) for i, url in enumerate(replicas)]


class HAProxy:
    """`start` binds the port and starts haproxy; `url` is the balancer's; `stop` ends it."""

    def __init__(self, root: Path, replicas: list[str], balance: str = ROUND_ROBIN) -> None:
        self.root = root
        self.replicas = replicas
        self.balance = balance
        self.url = ""
        self.process: ManagedProcess | None = None

    def start(self, timeout: float = 30.0) -> HAProxy:
        binary = shutil.which("haproxy")
        if binary is None:
            raise ProcessFailedError("haproxy is not installed (`make test` installs it)")
        self.root.mkdir(parents=True, exist_ok=True)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1024)
            config = self.root / "haproxy.cfg"
            config.write_text(
                haproxy_config(
                    listener.fileno(), self.replicas, self.root / "haproxy.sock", self.balance
                )
            )
            self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
            self.process = ManagedProcess(
                "haproxy",
                [binary, "-db", "-f", str(config)],
                self.root / "haproxy.log",
                pass_fds=[listener.fileno()],
            ).start()
        finally:
            # HAProxy holds its own copy now; ours would keep the port open after it dies.
            listener.close()
        self._wait_serving(timeout)
        return self

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or not self.process.running():
                tail = self.process.log_tail() if self.process else ""
                raise ProcessFailedError(f"haproxy exited:\n{tail}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise ProcessFailedError(f"haproxy not serving within {timeout:g}s")

    def servers_up(self) -> dict[str, bool]:
        """Whether HAProxy counts each replica up, from its stats socket (`show stat`)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stats:
            stats.settimeout(5)
            stats.connect(str(self.root / "haproxy.sock"))
            stats.sendall(b"show stat\n")
            data = b""
            while chunk := stats.recv(65536):
                data += chunk
        lines = data.decode().splitlines()
        columns = lines[0].removeprefix("# ").split(",")
        up = {}
        for line in lines[1:]:
            row = dict(zip(columns, line.split(","), strict=False))
            if row.get("pxname") == "gateways" and row["svname"] not in ("FRONTEND", "BACKEND"):
                up[row["svname"]] = row["status"].startswith("UP")
        return up

    def wait_all_up(self, timeout: float = 30.0) -> None:
        """Until every replica is in the rotation again (one restarted, say)."""
        deadline = time.monotonic() + timeout
        while not all(self.servers_up().values()):
            if time.monotonic() > deadline:
                raise ProcessFailedError(f"replicas not all up within {timeout:g}s")
            time.sleep(0.1)

    @property
    def pid(self) -> int:
        if self.process is None:
            raise ProcessFailedError("haproxy was not started")
        return self.process.pid

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace=5)
            self.process = None
