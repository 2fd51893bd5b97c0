"""Rollout benchmark: N replicas following models:/digits@champion, load at a fixed concurrency, the
alias moves.

The same fleet as tests/test_rollout.py (tests/fleet.py): a real MLflow tracking server
(`mlflow server`, SQLite and proxied artifacts, on the bridge's address: the replicas share no disk
with it; --sqlite: a SQLite file and local artifacts every replica opens, as the test does) with two
versions of a tiny model, N `python -m serving --reload-interval R` processes, each on its own host
(a network namespace of tests/hosts.py: own address, own working directory; where the machine can
make them, else, or with --loopback, on loopback ports, each in its own working and download
directory), behind nginx (Debian package; `proxy_next_upstream off`, so a replica's failure reaches
the client) or, with --no-nginx or without nginx, a client-side round robin. C client threads send
one two-row V2 JSON request each in a closed loop; after --before s @champion moves from 1 to 2; the
load goes on until every replica answered from version 2, then --after s more.

Printed, per replica: seconds from the alias move to its first answer from version 2 (its poll,
download, load, warm-up and swap), the last answer from version 1 after the move (in-flight requests
drained on the old session), answers per version (from the receipts, X-Model-Version), failed
requests, and p99 latency of the requests sent before the move, during the rollout (from the move
until the last replica switched) and after.

    python benchmarks/rollout.py                          # 3 replicas, concurrency 8, reload
                                                          interval 2 s
    python benchmarks/rollout.py --replicas 2 --concurrency 4 --no-nginx --loopback

Timings on a shared 2-core machine are noisy: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# tests/fleet.py: the replicas, the load, nginx
import fleet  # noqa: E402

# tests/hosts.py: network-namespace hosts
import hosts  # noqa: E402


def p99_ms(seconds: list[float]) -> str:
    return f"{np.percentile(seconds, 99) * 1e3:.1f}" if seconds else "-"


def table(
    answers: list[fleet.Answer], moved: float, switched: dict[str, float], names: dict[str, str]
) -> str:
    end = moved + max(switched.values(), default=0.0)
    rows = [
        (
            "replica",
            "converged s",
            "last v1 s",
            "v1 answers",
            "v2 answers",
            "failed",
            "p99 before ms",
            "p99 during ms",
            "p99 after ms",
        )
    ]

    def row(label: str, mine: list[fleet.Answer], converged: float | None) -> tuple:
        ok = [a for a in mine if a.status == 200]
        last_old = max(
            (a.done - moved for a in ok if a.version == "1" and a.done > moved), default=None
        )
        phases = (
            [a.seconds for a in ok if a.done - a.seconds < moved],
            [a.seconds for a in ok if moved <= a.done - a.seconds < end],
            [a.seconds for a in ok if a.done - a.seconds >= end],
        )
        return (
            label,
            "-" if converged is None else f"{converged:.2f}",
            "-" if last_old is None else f"{last_old:.2f}",
            sum(a.version == "1" for a in ok),
            sum(a.version == "2" for a in ok),
            len(mine) - len(ok),
            *(p99_ms(p) for p in phases),
        )

    for replica, name in sorted(names.items(), key=lambda kv: kv[1]):
        rows.append(row(name, [a for a in answers if a.replica == replica], switched.get(replica)))
    rows.append(row("all", answers, max(switched.values(), default=None)))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(str(c).rjust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def namespace_hosts(
    count: int, directory: Path, stack: contextlib.ExitStack
) -> tuple[list | None, str | None]:
    """`count` namespace hosts (tests/hosts.py) and the bridge's address in the root namespace,
    removed when `stack` closes; (None, None) where they can't be made."""
    reason = hosts.namespaces_unavailable()
    if reason:
        print(f"replicas on loopback: {reason}", file=sys.stderr)
        return None, None
    teardown: list = []
    stack.callback(lambda: [undo() for undo in reversed(teardown)])
    network = hosts.make_network(count, directory / "hosts", teardown)
    return network.hosts, network.gateway


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument(
        "--concurrency", type=int, default=8, help="client threads in a closed loop"
    )
    parser.add_argument("--reload-interval", type=float, default=2.0)
    parser.add_argument(
        "--before", type=float, default=5.0, help="seconds of load before the alias moves"
    )
    parser.add_argument(
        "--after", type=float, default=5.0, help="seconds of load after every replica switched"
    )
    parser.add_argument(
        "--no-nginx", action="store_true", help="client-side round robin instead of nginx"
    )
    parser.add_argument(
        "--loopback", action="store_true", help="replicas on loopback, not on namespace hosts"
    )
    parser.add_argument(
        "--sqlite",
        action="store_true",
        help="the registry as a SQLite file every replica opens, not an `mlflow server`",
    )
    args = parser.parse_args()
    if args.replicas < 1 or args.concurrency < 1:
        parser.error("--replicas and --concurrency must be at least 1")
    use_nginx = not args.no_nginx and fleet.nginx_missing() is None
    if not args.no_nginx and not use_nginx:
        print(f"no nginx ({fleet.nginx_missing()}): client-side round robin", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        directory = Path(tmp)
        with contextlib.ExitStack() as stack:
            machines, gateway = (
                (None, None) if args.loopback else namespace_hosts(args.replicas, directory, stack)
            )
            registry = directory / "registry"
            registry.mkdir()
            server = None
            # on the bridge's address, which every host reaches
            if not args.sqlite:
                server = stack.enter_context(
                    fleet.tracking_server(registry, gateway or "127.0.0.1")
                )
            tracking_uri = fleet.registered_versions(registry, 2, server)
            servers = stack.enter_context(
                fleet.replicas(
                    args.replicas,
                    tracking_uri,
                    directory,
                    hosts=machines,
                    reload_interval=args.reload_interval,
                )
            )
            urls = [s.url for s in servers]
            # nginx names the replica that answered in X-Upstream (host:port)
            if use_nginx:
                names = {u.removeprefix("http://"): f"replica-{i}" for i, u in enumerate(urls)}
                targets = [stack.enter_context(fleet.nginx(urls, directory))]
            else:
                names = {u: f"replica-{i}" for i, u in enumerate(urls)}
                targets = urls
            with fleet.Load(targets, clients=args.concurrency) as load:
                time.sleep(args.before)
                moved = fleet.move_alias(tracking_uri, "2")
                switched = fleet.wait_converged(load, moved, "2", set(names), limit=120.0)
                time.sleep(args.after)
            answers = load.snapshot()
    front = "nginx (round robin)" if use_nginx else "client-side round robin"
    where = "on loopback" if machines is None else "on namespace hosts"
    store = (
        "a SQLite registry file" if args.sqlite else "`mlflow server` (SQLite, proxied artifacts)"
    )
    print(
        f"\n{args.replicas} replicas {where} following {store}, behind {front}, concurrency {args.concurrency}, --reload-interval "
        f"{args.reload_interval:g}; @champion 1 -> 2 after {args.before:g} s; {len(answers)} requests\n"
    )
    print(table(answers, moved, switched, names))
    print(
        f"\nfleet converged {max(switched.values()):.2f} s after the alias move; "
        f"{len(fleet.failures(answers))} failed requests"
    )


if __name__ == "__main__":
    main()
