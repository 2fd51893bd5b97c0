"""`pipeline promote NAME --server URL`: the challenger judged on live traffic becomes the champion.

A server run with `--shadow FRACTION` mirrors a model's traffic to the version behind `@challenger`
and judges the pair (`GET /v2/models/NAME/shadow`, serving/shadow.py). This command reads that
verdict and, when it says `promote` for the very version the registry's `@challenger` names now,
moves `@champion` to it, records the figures it was judged on as that version's tags
(lineage.SHADOW_VERDICT and lineage.SHADOW), and drops `@challenger` (nothing is left to shadow). A
promote verdict counts only when it rests on labels (the report's `decided_by`): agreement any
inference client can steer never promotes. Any other verdict changes nothing and says why (exit 1);
`--force` moves the alias whatever the verdict, recording it as forced.

The move is checked after it is made: if another promotion moved `@champion` meanwhile, the command
says so (exit 1) instead of reporting a promotion that did not hold.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import requests

from pipeline import tracking
from pipeline.artifact import promotion
from pipeline.errors import TrackingError
from pipeline.tools import logs
from serving import lineage
from serving.shadow import LABELS

log = logging.getLogger("pipeline.promote")


class PromoteError(RuntimeError):
    """The verdict can't be read, or is not for the version the registry names."""


def main(
    name: str,
    server: str,
    token: str = "",
    tracking_uri: str = "",
    champion: str = "champion",
    challenger: str = "challenger",
    force: bool = False,
) -> dict[str, Any]:
    """{"promoted": bool, "version", "reason", "shadow": the server's report}."""
    tracking.use_store(tracking_uri)
    from serving.loader import registry_miss

    # a misspelt name, said before the server is asked
    if (missing := registry_miss(name)) is not None:
        raise PromoteError(missing)
    report = shadow_report(server, name, token)
    behind = tracking.alias_version(name, challenger)
    if behind is None:
        raise PromoteError(
            f"{name} has no @{challenger}; export a candidate first (it gets @{challenger} when it "
            "does not win at export)"
        )
    if str(report.get("challenger_version")) != behind:
        raise PromoteError(
            f"the server shadows version {report.get('challenger_version')} but @{challenger} names "
            f"version {behind} now; wait for the server to follow the alias (--reload-interval) and "
            "judge it"
        )
    holder = tracking.alias_version(name, champion)
    if str(report.get("champion_version")) != holder:
        raise PromoteError(
            f"the server judged against version {report.get('champion_version')} but @{champion} "
            f"names version {holder} now; wait for the server to follow it and judge again"
        )
    verdict, reason = report.get("verdict"), report.get("reason", "")
    if verdict == "promote" and report.get("decided_by") != LABELS and not force:
        return {
            "promoted": False,
            "version": behind,
            "reason": (
                f"the shadow verdict is promote, but it does not rest on labels ({reason}): agreement, "
                "which any inference client can steer, never promotes; serve with this version of "
                "trainserve and post labels with the feedback token, or pass --force"
            ),
            "shadow": report,
        }
    if verdict != "promote" and not force:
        return {
            "promoted": False,
            "version": behind,
            "reason": f"the shadow verdict is {verdict}: {reason}",
            "shadow": report,
        }
    tracking.set_version_tags(name, behind, shadow_tags(report, forced=verdict != "promote"))
    tracking.move_alias(name, champion, behind)
    tracking.describe_version(
        name,
        behind,
        tracking.version_description(name, behind)
        + "\n\n"
        + tracking.markdown_escaped(
            f"@{champion} since `pipeline promote`: shadow verdict {verdict}{' (forced)' if verdict != 'promote' else ''}: "
            f"{reason}"
        ),
    )
    now = tracking.alias_version(name, champion)
    if now != behind:
        return {
            "promoted": False,
            "version": behind,
            "shadow": report,
            "reason": f"@{champion} moved to version {now} while this promotion moved it to {behind}",
        }
    tracking.delete_alias(name, challenger)
    said = (
        f"pipeline promote: shadow verdict {verdict}{' (forced)' if verdict != 'promote' else ''}"
    )
    if holder is not None:
        promotion.record_alias_moved(name, champion, holder, behind, said)
    promotion.record_alias_taken(name, behind, challenger, champion, said)
    return {
        "promoted": True,
        "version": behind,
        "shadow": report,
        "reason": f"{'forced past a ' + str(verdict) + ' verdict' if verdict != 'promote' else reason}",
    }


def shadow_report(server: str, name: str, token: str = "") -> dict[str, Any]:
    url = f"{server.rstrip('/')}/v2/models/{name}/shadow"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        answer = requests.get(url, headers=headers, timeout=10)
    except requests.RequestException as exc:
        raise PromoteError(f"GET {url}: {logs.first_line(exc)}") from None
    if answer.status_code != 200:
        raise PromoteError(
            f"GET {url}: HTTP {answer.status_code}: {logs.clip(answer.text, 300)}"
            + ("; start the server with --shadow FRACTION" if answer.status_code == 404 else "")
        )
    return answer.json()


def shadow_tags(report: dict[str, Any], forced: bool) -> dict[str, str]:
    """The figures the version was judged on, as registry tags: the verdict, and every figure in one
    JSON record."""
    figures = {
        key: report.get(key)
        for key in (
            "reason",
            "pairs",
            "dropped",
            "champion_version",
            "latency_ms",
            "labels",
            "repeated_inputs",
            "sources",
            "largest_source_share",
            "labelled_pairs",
            "labelled_sources",
            "largest_labelled_source_share",
            "decided_by",
            "agreement",
            "mean_abs_difference",
            "live",
        )
        if key in report
    }
    # the JSON whole, within a tag's length
    figures["reason"] = logs.clip(str(figures.get("reason", "")), 2000)
    return {
        lineage.SHADOW_VERDICT: str(report.get("verdict")) + (" (forced)" if forced else ""),
        lineage.SHADOW: json.dumps(figures, sort_keys=True, default=str),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the registered model whose @challenger the server shadows")
    parser.add_argument(
        "--server", required=True, help="the server's base URL (started with --shadow FRACTION)"
    )
    parser.add_argument("--token", default="", help="the server's bearer token, if it has one")
    parser.add_argument(
        "--tracking-uri",
        default="",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, then sqlite:///mlflow.db)",
    )
    parser.add_argument(
        "--champion", default="champion", help="the alias the server serves (default champion)"
    )
    parser.add_argument(
        "--challenger",
        default="challenger",
        help="the alias it shadows, its --shadow-alias (default challenger)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="move @champion whatever the verdict (recorded as forced)",
    )


def cli(args: argparse.Namespace) -> int:
    logs.configure()
    try:
        result = main(
            args.name,
            args.server,
            args.token,
            args.tracking_uri,
            args.champion,
            args.challenger,
            force=args.force,
        )
    except (PromoteError, TrackingError) as exc:
        print(f"pipeline promote: error: {exc}", file=sys.stderr)
        return 2
    if not result["promoted"]:
        print(
            f"pipeline promote: not promoted: version {result['version']}: {result['reason']}",
            file=sys.stderr,
        )
        return 1
    print(
        f"promoted {args.name} version {result['version']} to @{args.champion}: {result['reason']}"
    )
    print(f"  judged on: {rested_on(result['shadow'])}")
    return 0


def rested_on(report: dict[str, Any]) -> str:
    """What a verdict rested on, in a line: the traffic that decided it, which one client may have
    shaped."""
    parts = [
        f"{report.get('distinct_inputs', report.get('pairs', 0))} distinct inputs paired",
        f"{report.get('repeated_inputs', 0)} repeats not counted",
        f"{report.get('dropped', 0)} shed",
    ]
    if "sources" in report:
        parts.append(
            f"from {report['sources']} client address(es), the largest "
            f"{report.get('largest_source_share', 0):.0%} of them"
        )
    if "agreement" in report:
        parts.append(f"top-1 agreement {report['agreement']:.1%}")
    labelled = f"{report.get('labels', 0)} labels ({report.get('labelled_pairs', 0)} on pairs"
    if "labelled_sources" in report:
        labelled += (
            f", from {report['labelled_sources']} client address(es), the largest "
            f"{report.get('largest_labelled_source_share', 0):.0%} of them"
        )
    parts.append(labelled + ")")
    return ", ".join(parts)
