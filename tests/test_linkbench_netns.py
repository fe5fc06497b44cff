"""``bench --link --netns``, slow tier: the namespaces, the veth pair and the ``tc tbf`` limit for real (root and
iproute2; skipped with the reason elsewhere).

Every pair is named after the process that made it (``psgdlb-<pid>-<n>a``), so several test processes can run at
once, and each test checks that its own names are gone afterwards. Nothing is sent outside the two namespaces: they
have no route but their own /24.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _deadline import scaled
from powersgd_triton.linkbench import netns
from powersgd_triton.linkbench.rates import parse_rate

ROOT = Path(__file__).resolve().parents[1]
_WHY = netns.refusal()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]


def root_links() -> str:
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout


def ours_left(pid: int):
    return [n for n in netns.namespaces() if n.startswith(f"{netns.PREFIX}-{pid}-")]


def test_the_pair_is_made_isolated_and_removed():
    with netns.LinkPair() as link:
        assert set(link.names) <= set(netns.namespaces())
        for side in (0, 1):
            links = subprocess.run(["ip", "-n", link.names[side], "-br", "addr"], capture_output=True, text=True,
                                   check=True).stdout
            assert link.veths[side] in links and f"{link.addresses[side]}/24" in links and "UP" in links
            routes = subprocess.run(["ip", "-n", link.names[side], "route"], capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()
            assert len(routes) == 1 and routes[0].startswith(f"{netns.SUBNET}.0/24 dev {link.veths[side]} "), routes
        assert not any(v in root_links() for v in link.veths)  # never in this namespace
        names, veths = link.names, link.veths
    assert not set(names) & set(netns.namespaces())
    assert not any(v in root_links() for v in veths)


def test_the_pair_is_removed_on_an_error():
    with pytest.raises(ZeroDivisionError):
        with netns.LinkPair() as link:
            names = link.names
            1 / 0
    assert not set(names) & set(netns.namespaces())


HOLDER = textwrap.dedent("""
    import sys, time
    from powersgd_triton.linkbench import netns
    with netns.LinkPair() as link:
        print(" ".join(link.names), flush=True)
        time.sleep(600)
""")


def _default_sigint():
    """In the child before it runs: SIGINT back to its default. A test run started in the background of a
    non-interactive shell inherits SIGINT ignored, and Python then never turns it into KeyboardInterrupt: the child
    would sleep through the test's Ctrl-C (a user at a terminal has it at its default)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_the_pair_is_removed_on_a_signal(sig):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), preexec_fn=_default_sigint)
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 2 and set(names) <= set(netns.namespaces())
        proc.send_signal(sig)
        proc.wait(scaled(60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not set(names) & set(netns.namespaces())


SERVER = textwrap.dedent("""
    import socket, sys
    n = int(sys.argv[2])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5201)); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept()
    got = 0
    while got < n:
        got += len(c.recv(1 << 20))
    c.sendall(b"k")
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    n = int(sys.argv[2])
    c = socket.create_connection((sys.argv[1], 5201), timeout=120)
    payload = bytes(n)
    t0 = time.perf_counter()
    c.sendall(payload)
    assert c.recv(1) == b"k"
    print(time.perf_counter() - t0)
""")


def transfer_seconds(link: netns.LinkPair, nbytes: int) -> float:
    """Seconds to send ``nbytes`` over TCP from namespace b to namespace a (until the receiver says it has them)."""
    server = subprocess.Popen(link.command(0, [sys.executable, "-c", SERVER, link.addresses[0], str(nbytes)]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(link.command(1, [sys.executable, "-c", CLIENT, link.addresses[0], str(nbytes)]),
                             capture_output=True, text=True, timeout=scaled(120))
        assert out.returncode == 0, out.stderr
        server.wait(scaled(30))
        return float(out.stdout)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_the_rate_limit_holds_a_known_payload_to_its_rate():
    """3 MB at 40 and 160 Mbit/s: the transfer takes its payload's time at the rate (with TCP/IP and Ethernet headers,
    1514 bytes on the wire per 1448 of payload), within [0.85, 1.6] of it; unlimited, at least 3x less than at 160."""
    nbytes = 3_000_000
    wire = nbytes * 1514 / 1448 * 8
    with netns.LinkPair() as link:
        measured = {}
        for label in ("40mbit", "160mbit", "unlimited"):
            rate = parse_rate(label)
            link.set_rate(rate)
            shown = link.qdisc(0) + link.qdisc(1)
            assert (shown.count("tbf") == 2) == rate.limited, shown
            measured[label] = transfer_seconds(link, nbytes)
            if rate.limited:
                expected = wire / rate.bits_per_second
                assert 0.85 <= measured[label] / expected <= 1.6, (label, measured[label], expected)
        assert measured["160mbit"] / measured["unlimited"] >= 3.0, measured
        names = link.names
    assert not set(names) & set(netns.namespaces())


def run_cli(*args, timeout=900, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **kwargs.pop("env", {}))
    kwargs.setdefault("preexec_fn", _default_sigint)
    return subprocess.Popen([sys.executable, "-m", "powersgd_triton", "bench", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_the_command_end_to_end(tmp_path):
    """digits at 50 Mbit/s and unlimited, three hooks: exit 0, the rows (all-reduce's bytes are the model's gradient
    bytes; ours sends what PyTorch's hook sends, same buckets), the chart, and no namespace left."""
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    proc = run_cli("--link", "50mbit,unlimited", "--netns", "--workload", "digits", "--hooks",
                   "allreduce,reference,powersgd", "--steps", "3", "--start-iter", "2", "--out", str(out),
                   "--plot", str(png))
    stdout, stderr = proc.communicate(timeout=scaled(900))
    assert proc.returncode == 0, stderr + stdout
    assert not ours_left(proc.pid)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rate"], r["hook"]) for r in rows] == [(rate, h) for rate in ("50mbit", "unlimited")
                                                      for h in ("allreduce", "reference", "powersgd")]
    from powersgd_triton.train.models import DigitsConvNet

    grad_bytes = sum(p.numel() * 4 for p in DigitsConvNet().parameters())
    for r in rows:
        assert r["step_ms_p10"] <= r["step_ms_median"] <= r["step_ms_p90"]
        if r["hook"] == "allreduce":
            assert r["bytes_per_step"] == grad_bytes and r["ratio_to_allreduce"] == 1.0
        else:
            assert r["bytes_per_step"] < grad_bytes / 5
    for rate in ("50mbit", "unlimited"):
        ours, torch_hook = (next(r for r in rows if r["rate"] == rate and r["hook"] == h)
                            for h in ("powersgd", "reference"))
        assert ours["bytes_per_step"] == torch_hook["bytes_per_step"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "digits: powersgd" in stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_command_stops_its_ranks_and_removes_the_namespaces_on_a_signal(tmp_path, sig):
    proc = run_cli("--link", "20mbit", "--netns", "--workload", "digits", "--steps", "500",
                   env={"TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + scaled(120)
        while not list(tmp_path.glob("powersgd-link-*/rank1.log")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ours_left(proc.pid), "the namespaces were never made"
        time.sleep(2)  # the ranks are starting
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=scaled(60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "interrupted; the ranks were stopped and the namespaces removed" in stderr
    assert not ours_left(proc.pid)
    ranks = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(tmp_path) in text:
            ranks.append(cmdline.parent.name)
    assert not ranks, f"rank processes left: {ranks}"
