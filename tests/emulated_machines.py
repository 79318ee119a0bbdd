"""Machines emulated on this one, for tests that drive them as a user drives real ones: over SSH.

Each machine is a set of Linux namespaces of its own, started with ``unshare`` (root only):
- network: its own interface (a veth pair to a private bridge) and address on a subnet no other process sees;
- PID: its own process table (with its own /proc), so a `ray stop` run there ends that machine's Ray only;
- mount: its own /tmp, home (/home/ubuntu), /run and /mnt/shared (one folder that every machine mounts, as an
  NFS export would be), and copies of /etc/passwd, /etc/hosts and /etc/resolv.conf (the user ``ubuntu``; the
  machines' names; no name server, so a lookup fails at once instead of timing out);
- UTS: its own hostname.
A machine's home starts empty, as a fresh account's can be (no ~/.profile): what the cluster config writes there
is all there is, so a command that relies on a login shell reading ~/.bashrc fails here as it would there.
The rest of the file system (/usr, the Python and the venv that run the tests) is the host's, read as it is.

The machine's first process is its sshd (PID 1 of its namespace), listening on the machine's address only, with a
throwaway host key and one authorized key (the caller's throwaway key). Stopping that sshd by its pid ends every
process of the machine (the kernel ends a PID namespace with its first process); the teardown then kills, by pid,
anything left in the namespaces it made. Never `ray stop` on this machine's default namespaces, never a kill
by name.

The user ``ubuntu`` is uid 0 inside the machines (this runs as root; a second account would be a change to the
host's /etc/passwd). Its home, and root's home in the machines' copy of /etc/passwd, is the machine's own folder,
so nothing a machine writes under ``~`` (``~/.bashrc``, ``~/.ssh``) reaches the host's /root.

The "launcher" is where a user runs `ray up` from: the bridge's own network namespace (address ``.1`` of the
subnet), with a private /tmp and home (``/home/launcher``, ``$HOME``) in a mount namespace and a PID namespace per
command (the SSH control connections a command leaves end with it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from multinode_cluster import alive, end_processes

NODE_INIT = r"""
set -euo pipefail
n=$RFL_NODE_DIR r=$RFL_ROOT
for _ in $(seq 600); do [ -e "$n/net-ready" ] && break; sleep 0.05; done
[ -e "$n/net-ready" ] || { echo "emulated machine $RFL_NODE_NAME: its network was not set up" >&2; exit 1; }
# What sshd reads is copied first: /tmp (where $r lives) is replaced last.
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -m 755 /run/sshd /run/rfl
cp "$n/sshd_config" "$r/host_key" "$r/authorized_keys" /run/rfl/
chmod 600 /run/rfl/host_key
mount --bind "$r/etc/passwd" /etc/passwd
mount --bind "$r/etc/hosts" /etc/hosts
mount --bind "$r/etc/resolv.conf" /etc/resolv.conf
mount -t tmpfs -o mode=755 tmpfs /home
mkdir /home/ubuntu
mount --bind "$n/home" /home/ubuntu
mount -t tmpfs -o mode=755 tmpfs /mnt
mkdir /mnt/shared
mount --bind "$r/shared" /mnt/shared
mount --bind "$n/tmp" /tmp
hostname "$RFL_NODE_NAME"
exec /usr/sbin/sshd -D -e -f /run/rfl/sshd_config
"""

LAUNCHER_INIT = r"""
set -euo pipefail
r=$RFL_ROOT
mount -t tmpfs -o mode=755 tmpfs /home
mkdir /home/launcher
mount --bind "$r/launcher/home" /home/launcher
mount --bind "$r/etc/passwd-launcher" /etc/passwd
mount --bind "$r/etc/hosts" /etc/hosts
mount --bind "$r/etc/resolv.conf" /etc/resolv.conf
mount --bind "$r/launcher/tmp" /tmp
cd "$RFL_CWD"
exec "$@"
"""

SSHD_CONFIG = """\
ListenAddress {ip}
Port 22
HostKey /run/rfl/host_key
AuthorizedKeysFile /run/rfl/authorized_keys
PidFile none
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PrintMotd no
MaxStartups 100
MaxSessions 100
Subsystem sftp internal-sftp
"""


def missing_tools() -> list[str]:
    """What the emulation needs and this machine lacks (root, the programs)."""
    missing = [] if os.geteuid() == 0 else ["root (namespaces, mounts, a bridge)"]
    for tool in ("unshare", "nsenter", "ip", "ss", "ssh", "ssh-keygen", "rsync", "/usr/sbin/sshd"):
        if shutil.which(tool) is None:
            missing.append(tool)
    if not missing:  # root in a container may still be refused new namespaces
        probe = subprocess.run(["unshare", "--net", "--pid", "--mount", "--uts", "--fork", "--mount-proc", "true"],
                               capture_output=True, text=True, timeout=20)
        if probe.returncode != 0:
            missing.append(f"permission to make namespaces ({probe.stderr.strip()[:200]})")
    return missing


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _ns(pid: int, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass
class Machine:
    name: str
    ip: str
    dir: Path
    unshare: subprocess.Popen | None = None
    init_pid: int | None = None  # the sshd, PID 1 of the machine's namespace, as the host numbers it
    pid_ns: str | None = None
    net_ns: str | None = None
    log: object = field(default=None, repr=False)

    @property
    def home(self) -> Path:
        return self.dir / "home"

    @property
    def tmp(self) -> Path:
        return self.dir / "tmp"


class Machines:
    """A private bridge with ``names`` on it (addresses ``subnet.10``, ``.11``, ...) and the launcher on ``.1``.

    Use as a context manager; ``close()`` (also on failure) stops every sshd by pid and checks that nothing
    of the namespaces is left."""

    def __init__(self, root: str, names: list[str], subnet: str = "10.213.0", start_timeout: float = 30):
        if missing := missing_tools():
            raise RuntimeError(f"cannot emulate machines here, missing: {', '.join(missing)}")
        self.root, self.subnet = Path(root), subnet
        self.launcher_ip = f"{subnet}.1"
        self.machines = {name: Machine(name, f"{subnet}.{10 + i}", self.root / "machines" / name)
                         for i, name in enumerate(names)}
        self.lan: subprocess.Popen | None = None
        self.started: list[subprocess.Popen] = []
        try:
            self._prepare_files()
            self._start(start_timeout)
        except BaseException:
            self.close()
            raise

    # --- set-up --------------------------------------------------------------------------------------------

    def _prepare_files(self) -> None:
        r = self.root
        for d in ("etc", "shared", "launcher/home/.ssh", "launcher/tmp"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "launcher" / "tmp", 0o1777)
        os.chmod(r / "shared", 0o777)
        host_passwd = [line for line in Path("/etc/passwd").read_text().splitlines()
                       if line and not line.startswith(("root:", "ubuntu:"))]
        node_home = "root:x:0:0:root:/home/ubuntu:/bin/bash\nubuntu:x:0:0:emulated machine:/home/ubuntu:/bin/bash\n"
        (r / "etc" / "passwd").write_text(node_home + "\n".join(host_passwd) + "\n")
        (r / "etc" / "passwd-launcher").write_text(
            "root:x:0:0:root:/home/launcher:/bin/bash\n" + "\n".join(host_passwd) + "\n")
        (r / "etc" / "hosts").write_text("127.0.0.1 localhost\n" + f"{self.launcher_ip} launcher\n" + "".join(
            f"{m.ip} {m.name}\n" for m in self.machines.values()))
        (r / "etc" / "resolv.conf").write_text("# no name server on the emulated network\n")
        key = r / "launcher" / "home" / ".ssh" / "id_ed25519"
        for path, comment in ((r / "host_key", "host"), (key, "launcher")):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"rayfl-test-{comment}",
                            "-f", str(path)], check=True, capture_output=True)
        shutil.copy(f"{key}.pub", r / "authorized_keys")
        for m in self.machines.values():
            m.home.mkdir(parents=True)
            m.tmp.mkdir(parents=True)
            os.chmod(m.tmp, 0o1777)
            (m.dir / "sshd_config").write_text(SSHD_CONFIG.format(ip=m.ip))

    def _ip_lan(self, *args: str) -> None:
        subprocess.run(["nsenter", f"--net=/proc/{self.lan.pid}/ns/net", "ip", *args], check=True,
                       capture_output=True, text=True, timeout=20)

    def _start(self, timeout: float) -> None:
        # The bridge lives in a network namespace of its own, held by a process that only sleeps.
        self.lan = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"], start_new_session=True)
        self.started.append(self.lan)
        deadline = time.monotonic() + 10
        while _ns(self.lan.pid, "net") == _ns(os.getpid(), "net"):
            if time.monotonic() > deadline or self.lan.poll() is not None:
                raise RuntimeError("the emulated network did not start (unshare --net)")
            time.sleep(0.02)
        self._ip_lan("link", "set", "lo", "up")
        self._ip_lan("link", "add", "rflbr0", "type", "bridge")
        self._ip_lan("addr", "add", f"{self.launcher_ip}/24", "dev", "rflbr0")
        self._ip_lan("link", "set", "rflbr0", "up")
        env = {**os.environ, "RFL_ROOT": str(self.root)}
        for m in self.machines.values():
            m.log = open(m.dir / "sshd.log", "w")
            m.unshare = subprocess.Popen(
                ["unshare", "--net", "--pid", "--mount", "--uts", "--fork", "--mount-proc",
                 "--propagation", "private", "--kill-child", "--", "bash", "-c", NODE_INIT],
                env={**env, "RFL_NODE_DIR": str(m.dir), "RFL_NODE_NAME": m.name},
                stdout=m.log, stderr=subprocess.STDOUT, start_new_session=True)
            self.started.append(m.unshare)
        deadline = time.monotonic() + timeout
        for i, m in enumerate(self.machines.values()):
            while not (kids := _children(m.unshare.pid)) or _ns(m.unshare.pid, "net") == _ns(os.getpid(), "net"):
                if time.monotonic() > deadline or m.unshare.poll() is not None:
                    raise RuntimeError(f"emulated machine {m.name} did not start:\n{self.log_of(m)}")
                time.sleep(0.02)
            m.init_pid = kids[0]
            m.pid_ns, m.net_ns = _ns(m.init_pid, "pid"), _ns(m.unshare.pid, "net")
            # A veth pair: one end on the bridge, the other the machine's eth0, with its address and a default
            # route through the bridge (Ray picks a node's address from the route out).
            self._ip_lan("link", "add", f"rflv{i}", "type", "veth", "peer", "name", "eth0", "netns",
                         str(m.unshare.pid))
            self._ip_lan("link", "set", f"rflv{i}", "master", "rflbr0", "up")
            for args in (["link", "set", "lo", "up"], ["addr", "add", f"{m.ip}/24", "dev", "eth0"],
                         ["link", "set", "eth0", "up"], ["route", "add", "default", "via", self.launcher_ip]):
                subprocess.run(["nsenter", f"--net=/proc/{m.unshare.pid}/ns/net", "ip", *args], check=True,
                               capture_output=True, text=True, timeout=20)
            (m.dir / "net-ready").touch()
        for m in self.machines.values():  # sshd listens when it answers on port 22
            while not self.lan_run(["bash", "-c", f"exec 3<>/dev/tcp/{m.ip}/22"], timeout=5).returncode == 0:
                if time.monotonic() > deadline or m.unshare.poll() is not None:
                    raise RuntimeError(f"the sshd of emulated machine {m.name} does not answer:\n{self.log_of(m)}")
                time.sleep(0.1)

    # --- use -----------------------------------------------------------------------------------------------

    def log_of(self, m: Machine) -> str:
        try:
            return (m.dir / "sshd.log").read_text()[-3000:]
        except OSError:
            return ""

    def lan_run(self, cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        """``cmd`` in the bridge's network namespace (the host's files and processes otherwise)."""
        return subprocess.run(["nsenter", f"--net=/proc/{self.lan.pid}/ns/net", "--", *cmd], capture_output=True,
                              text=True, timeout=timeout, **kw)

    def machine_run(self, m: Machine, cmd: list[str], timeout: float = 20) -> subprocess.CompletedProcess:
        """``cmd`` in machine ``m``'s network namespace (to see what listens there)."""
        return subprocess.run(["nsenter", f"--net=/proc/{m.unshare.pid}/ns/net", "--", *cmd], capture_output=True,
                              text=True, timeout=timeout)

    def launcher_command(self, cmd: list[str]) -> list[str]:
        """``cmd`` as run on the launcher: the bridge's network, a private /tmp and home, a PID namespace of its
        own (what it leaves running ends with it)."""
        return ["nsenter", f"--net=/proc/{self.lan.pid}/ns/net", "--",
                "unshare", "--pid", "--mount", "--fork", "--mount-proc", "--propagation", "private",
                "--kill-child", "--", "bash", "-c", LAUNCHER_INIT, "launcher", *cmd]

    def launcher_env(self, cwd: str, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "MLFLOW_", "SSH_", "PYTEST_")) and k not in ("PYTHONPATH",)}
        env.update({"HOME": "/home/launcher", "USER": "root", "RFL_ROOT": str(self.root), "RFL_CWD": cwd})
        env.update(extra)
        return env

    @property
    def launcher_home(self) -> Path:
        return self.root / "launcher" / "home"

    def processes(self, m: Machine) -> list[tuple[int, str]]:
        """(host pid, command line) of every live process on machine ``m``."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and _ns(int(entry.name), "pid") == m.pid_ns and alive(int(entry.name)):
                found.append((int(entry.name), _cmdline(int(entry.name))))
        return found

    # --- teardown ------------------------------------------------------------------------------------------

    def _ours(self) -> list[int]:
        """Processes in a namespace this object made (machines' PID and network namespaces, the bridge's)."""
        namespaces = {ns for m in self.machines.values() for ns in (m.pid_ns, m.net_ns) if ns}
        if self.lan is not None and (lan := _ns(self.lan.pid, "net")):
            namespaces.add(lan)
        namespaces -= {_ns(os.getpid(), "net"), _ns(os.getpid(), "pid"), None}  # never the host's own
        me, found = os.getpid(), []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != me:
                pid = int(entry.name)
                if _ns(pid, "pid") in namespaces or _ns(pid, "net") in namespaces:
                    found.append(pid)
        return found

    def close(self) -> list[int]:
        """Stop every machine (its sshd by pid, which ends its PID namespace), the bridge, and anything left in
        their namespaces; returns the pids that survived (none, unless the kernel refused)."""
        for m in self.machines.values():
            if m.init_pid is not None and alive(m.init_pid):
                try:
                    os.kill(m.init_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        survivors = end_processes(self._ours())
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                survivors.append(proc.pid)
        for m in self.machines.values():
            if m.log is not None:
                m.log.close()
        return survivors

    def __enter__(self) -> "Machines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
