"""Two network namespaces joined by a veth pair, with a ``tc tbf`` rate limit on each end (``bench --link --netns``).

:class:`LinkPair` makes a slow link on one machine: namespace ``a`` holds one end of a veth pair (address
``10.213.0.1/24``), namespace ``b`` the other (``10.213.0.2/24``); each namespace has only its loopback and its veth
end, and no route anywhere else, so nothing the ranks send can leave the two namespaces. :meth:`LinkPair.set_rate`
puts a token-bucket filter (``tc qdisc replace dev VETH root tbf rate ...``) on both ends, so each direction carries
at most that rate; ``unlimited`` removes it. :meth:`LinkPair.command` wraps a command line in ``ip netns exec``.

The pair is always removed again: on leaving the ``with`` block, on an error, on Ctrl-C, on SIGTERM or SIGHUP (turned
into :class:`Terminated` while the block runs) and at interpreter exit. Deleting a namespace deletes the veth end in
it, and with it its peer. Names carry the process id and a counter (``psgdlb-<pid>-<n>a``, veth ``plb<pid>x<n>a``), so
several processes can hold pairs at once; only a SIGKILL leaves a pair behind (``ip netns list``, then ``ip netns
del NAME``).

Needs root and iproute2 (``ip``, ``tc``): :func:`refusal` says in one line why not, ``None`` when it can run.
"""

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import threading
import time
from typing import Dict, List, Optional, Sequence

from powersgd_triton.linkbench.rates import Rate, tbf_args

PREFIX = "psgdlb"
SUBNET = "10.213.0"  # private; it exists only inside the two namespaces
_COUNTER = itertools.count()
_LIVE: Dict[int, "LinkPair"] = {}  # id -> pair, removed at exit if still there


class NetnsError(RuntimeError):
    """A namespace, veth or qdisc command failed; the message has the command and its stderr."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while a :class:`LinkPair` was held (a ``KeyboardInterrupt``, so that cleanup code
    written for Ctrl-C runs for it too); ``signum`` says which."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"signal {signal.Signals(signum).name}")


def refusal(euid: Optional[int] = None) -> Optional[str]:
    """Why ``--netns`` cannot run here, in one line (not root; ``ip`` or ``tc`` missing), or ``None``."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return ("--netns needs root (it creates network namespaces, a veth pair and tc qdiscs); run it as root, or "
                "without --netns under torchrun on your own nodes")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"--netns needs iproute2 ({' and '.join(missing)} not found on PATH): apt-get install iproute2 "
                "(Debian, Ubuntu) or dnf install iproute (Fedora)")
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces() -> List[str]:
    """The network namespace names ``ip netns list`` shows (all of them, not only ours)."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


class LinkPair:
    """Namespaces ``names[0]`` (rank 0's side) and ``names[1]``, joined by veth ends ``veths[0]``/``veths[1]`` at
    ``addresses[0]``/``addresses[1]``. Use as a context manager: ``with LinkPair() as link: link.set_rate(...)``.

    ``signals``: turn SIGTERM/SIGHUP into :class:`Terminated` while the pair is held (main thread only), so the
    ``with`` block unwinds and the pair is removed."""

    def __init__(self, signals: bool = True):
        n = next(_COUNTER)
        pid = os.getpid()
        self.names = (f"{PREFIX}-{pid}-{n}a", f"{PREFIX}-{pid}-{n}b")
        self.veths = (f"plb{pid}x{n}a", f"plb{pid}x{n}b")
        if max(len(v) for v in self.veths) > 15:  # IFNAMSIZ - 1
            raise NetnsError(f"veth name {self.veths[0]!r} is longer than Linux's 15 characters")
        self.addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.rate: Optional[Rate] = None
        self._signals = signals
        self._saved_handlers: Dict[int, object] = {}
        self._created = False

    # ------------------------------------------------------------------------------------------------- lifetime
    def __enter__(self) -> "LinkPair":
        self._install_signals()
        try:
            self.create()
        except BaseException:
            self.remove()
            self._restore_signals()
            raise
        return self

    def __exit__(self, *exc) -> None:
        # a signal arriving while the pair is removed waits until it is gone, then acts as it would have
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        main = threading.current_thread() is threading.main_thread()
        if main:
            signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            self.remove()
        finally:
            self._restore_signals()
            if main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, held)

    def create(self) -> None:
        """Make both namespaces, the veth pair (created inside them: never in this namespace), addresses, links up.
        Raises :class:`NetnsError`; what was made is removed by :meth:`remove`."""
        _LIVE[id(self)] = self
        self._created = True
        a, b = self.names
        va, vb = self.veths
        _run(["ip", "netns", "add", a])
        _run(["ip", "netns", "add", b])
        _run(["ip", "-n", a, "link", "add", va, "type", "veth", "peer", "name", vb, "netns", b])
        for ns, veth, addr in zip(self.names, self.veths, self.addresses):
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth])
            _run(["ip", "-n", ns, "link", "set", veth, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        deadline = time.monotonic() + 10.0  # the kernel marks a veth end UP a moment after both are set up
        while not all(self.is_up(side) for side in (0, 1)):
            if time.monotonic() > deadline:
                raise NetnsError(f"the veth pair {va}/{vb} did not come up within 10 s")
            time.sleep(0.05)

    def is_up(self, side: int) -> bool:
        """Whether veth end ``side`` is up (its operational state, as ``ip -br link`` shows it)."""
        out = _run(["ip", "-n", self.names[side], "-br", "link", "show", "dev", self.veths[side]]).stdout.split()
        return len(out) > 1 and out[1] == "UP"

    def remove(self) -> None:
        """Delete both namespaces (and so the veth pair); quiet about what is already gone. Idempotent. Raises
        :class:`NetnsError` when a namespace of ours is still listed afterwards."""
        _LIVE.pop(id(self), None)
        if not self._created:
            return
        self._created = False
        for ns in self.names:
            _run(["ip", "netns", "del", ns], check=False)
        left = [ns for ns in self.names if ns in namespaces()]
        if left:
            raise NetnsError(f"could not remove network namespace(s) {', '.join(left)}: ip netns del NAME")

    # ------------------------------------------------------------------------------------------------- use
    def set_rate(self, rate: Rate) -> None:
        """Limit each direction to ``rate`` (a tbf qdisc on both veth ends), or remove the limit (unlimited)."""
        for side, (ns, veth) in enumerate(zip(self.names, self.veths)):
            if rate.limited:
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", veth, "root"] + tbf_args(rate.bits_per_second))
            elif "tbf" in self.qdisc(side):
                _run(["tc", "-n", ns, "qdisc", "del", "dev", veth, "root"])
        self.rate = rate

    def qdisc(self, side: int) -> str:
        """``tc qdisc show`` of one veth end (what limits it now)."""
        return _run(["tc", "-n", self.names[side], "qdisc", "show", "dev", self.veths[side]]).stdout.strip()

    def command(self, side: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside namespace ``side`` (0 or 1): ``["ip", "netns", "exec", NAME, *argv]``. The
        environment passes through; ``ip netns exec`` execs the command, so its pid is the child's."""
        return ["ip", "netns", "exec", self.names[side]] + list(argv)

    # ------------------------------------------------------------------------------------------------- signals
    def _install_signals(self) -> None:
        if not self._signals or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            raise Terminated(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._saved_handlers[sig] = signal.signal(sig, handler)

    def _restore_signals(self) -> None:
        while self._saved_handlers:
            sig, old = self._saved_handlers.popitem()
            signal.signal(sig, old)


@atexit.register
def _remove_leftovers() -> None:  # an interpreter leaving with a pair still held (sys.exit inside the block)
    for pair in list(_LIVE.values()):
        try:
            pair.remove()
        except Exception:  # noqa: BLE001 - nothing left to report to at exit
            pass
