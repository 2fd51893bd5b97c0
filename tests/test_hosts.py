"""The namespace hosts multi-machine tests run on: reachable by address, isolated, and removed
after."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

# the fixture
from hosts import hosts  # noqa: F401


def test_hosts_reach_each_other_and_the_gateway_and_are_removed_after(hosts):  # noqa: F811
    network = hosts(2)
    a, b = network.hosts
    assert a.address != b.address and a.workdir != b.workdir and not any(a.workdir.iterdir())
    # a service of the root namespace, bound to the bridge's address
    with socket.socket() as root_service:
        root_service.bind((network.gateway, 0))
        root_service.listen()
        port = root_service.getsockname()[1]
        reach = f"import socket; socket.create_connection(({network.gateway!r}, {port}), timeout=5)"
        a.run([sys.executable, "-c", reach], timeout=20)
    listener = a.popen(
        [
            sys.executable,
            "-c",
            f"import socket; s = socket.create_server(({a.address!r}, 7001)); "
            "print('up', flush=True); c, _ = s.accept(); c.sendall(b'from a')",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert listener.stdout.readline().strip() == "up"
    got = b.run(
        [
            sys.executable,
            "-c",
            f"import socket; print(socket.create_connection(({a.address!r}, 7001), "
            "timeout=5).recv(16).decode())",
        ],
        timeout=20,
    )
    assert got.stdout.strip() == "from a"
    # Each host sees only its own link: the machine's interfaces are not there.
    links = a.run(["ip", "-o", "link"]).stdout
    assert "eth0" in links and network.bridge not in links
    names = [h.name for h in network.hosts]
    assert set(names) <= set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    )


def test_a_failing_test_still_leaves_no_namespace_behind(tmp_path):
    (tmp_path / "test_fails.py").write_text(
        textwrap.dedent(f"""
        import subprocess, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from hosts import hosts

        def test_fails(hosts):
            network = hosts(2)
            open("names", "w").write(" ".join(h.name for h in network.hosts) + " " + network.bridge)
            subprocess.Popen(network.hosts[0].command(["sleep", "600"]))  # started outside Host.popen
            assert False
    """)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_fails.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 failed" in proc.stdout, proc.stdout[-3000:]
    *names, bridge = (tmp_path / "names").read_text().split()
    assert not set(names) & set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    )
    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0
