"""`pipeline data shard --config configs/X.yaml --out DIR|s3://bucket/prefix [key=value ...]`: a
config's data, written as shards.

Builds the config's data component (checked as training checks it), writes its training and
validation splits under OUT/train and OUT/val (pipeline/shards/format.py: Parquet shards and a
manifest each; images with the transform that made them and, for validation, a few of their files),
and prints the manifests' digests and the whole `pipeline run` command that trains from them
(`data.name=sharded "data.args={root: OUT}"`): the way a map-style data set, or one too large to
hash at every start, becomes a stream any number of ranks can read.
"""

from __future__ import annotations

import argparse
import sys
import time

from pipeline.errors import ConfigError, DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=["shard"],
        help="shard: write the config's train and val splits as Parquet shards with a manifest each",
    )
    parser.add_argument(
        "--config", help="YAML config whose data section names the data (configs/*.yaml)"
    )
    parser.add_argument(
        "--out",
        required=True,
        help="a directory or s3://bucket/prefix; OUT/train and OUT/val are written",
    )
    parser.add_argument(
        "--rows-per-shard",
        type=int,
        default=0,
        help="samples a shard file (default: ~256 MiB of them)",
    )
    parser.add_argument(
        "--rows-per-group",
        type=int,
        default=0,
        help="samples a row group, the unit the stream shuffles and reads (default: ~4 MiB of them)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides of the data section, e.g. data.args.val_fraction=0.1",
    )


def main(
    config: str | None,
    overrides: list[str],
    out: str,
    rows_per_shard: int = 0,
    rows_per_group: int = 0,
) -> dict:
    """{split: Manifest} of the config's splits written under `out`."""
    from pipeline.components.build import build_data
    from pipeline.config import load_config
    from pipeline.shards import format as shard_format

    cfg = load_config(config, overrides)
    splits = build_data(cfg.data, cfg.task.name)
    from torch.utils.data import IterableDataset

    from pipeline.shards.stream import ShardedStream

    if isinstance(splits.train, ShardedStream):
        raise DataError(
            f"data.component '{cfg.data.component}' is already sharded; copy its directory instead"
        )
    if isinstance(splits.train, IterableDataset):
        raise DataError(
            f"data.component '{cfg.data.component}' returns a stream; `pipeline data shard` writes map-style "
            "data (indexable, with len()): give it the map-style form of the data"
        )
    written = {}
    # Images: the transform travels with both splits; the validation split keeps the files it is
    # proven on.
    transform = splits.preprocessing.to_json() if splits.preprocessing is not None else None
    for split in ("train", "val"):
        dataset = getattr(splits, split)
        profile: dict = {}
        source = getattr(dataset, "source_images", None) if transform and split == "val" else None
        examples = source() if source is not None else []
        samples = _profiled(dataset, profile)
        written[split] = shard_format.write_split(
            samples,
            shard_format.join(out, split),
            rows_per_shard=rows_per_shard,
            rows_per_group=rows_per_group,
            classes=splits.classes,
            model_args=splits.model_hints if split == "train" else {},
            source={"component": cfg.data.component, "args": cfg.data.args, "split": split},
            targets=profile,
            preprocessing=transform,
            examples=examples,
        )
    return written


def _profiled(dataset, profile: dict, every: int = 1024):
    """(id, inputs, target) of each sample, read once; `profile` becomes the targets' profile (class
    counts or statistics, data.target_profile) as they pass, for MLflow's dataset drawer."""
    from pipeline.components.data import leaves, merged_profile, target_profile

    targets = []
    for i in range(len(dataset)):
        inputs, target = dataset[i]
        targets.extend(leaves(target)[:1])
        if len(targets) >= every:
            profile.update(merged_profile([profile, target_profile(targets)], totals=True))
            targets = []
        yield i, inputs, target
    final = merged_profile([profile, target_profile(targets)])
    profile.clear()
    profile.update(final)


def cli(args) -> int:
    try:
        if args.rows_per_shard < 0 or args.rows_per_group < 0:
            raise ConfigError(
                "--rows-per-shard and --rows-per-group are counts of samples: give a positive number, "
                "or 0 (or leave them out) for the defaults"
            )
        started = time.perf_counter()
        written = main(
            args.config, args.overrides, args.out, args.rows_per_shard, args.rows_per_group
        )
    except (ConfigError, DataError) as exc:
        print(f"pipeline data shard: error: {exc}", file=sys.stderr)
        return 2
    for split, manifest in written.items():
        groups = sum(len(s.row_groups) for s in manifest.shards)
        print(
            f"{split:5s} {manifest.rows} samples in {len(manifest.shards)} shards ({groups} row groups), manifest "
            f"sha256 {manifest.digest[:16]}: {manifest.location}"
        )
    print(f"written in {time.perf_counter() - started:.1f} s; train from them with:")
    print("  " + train_command(args.config, args.overrides, args.out))
    return 0


def train_command(config: str | None, overrides: list[str], out: str) -> str:
    """The whole `pipeline run` command, one line for a shell, that trains from the shards in `out`
    with the config the shards were written with: its overrides of the data's component and args
    give way to `data.name=sharded` and a `data.args` mapping that replaces the file's
    (data.args.root=OUT alone would keep the file's other args, such as the digits' val_fraction,
    which the shards don't take)."""
    import shlex

    import yaml

    replaced = ("data.component", "data.name", "data.args")
    kept = [o for o in overrides if not o.partition("=")[0].strip().startswith(replaced)]
    root = yaml.safe_dump({"root": out.rstrip("/")}, default_flow_style=True, width=1 << 30)
    return shlex.join(
        [
            *program(),
            "run",
            *(["--config", config] if config else []),
            *kept,
            "data.name=sharded",
            f"data.args={root.strip()}",
        ]
    )


def program() -> list[str]:
    """`pipeline` as this process was started: the script's path as typed (`.venv/bin/pipeline`), or
    the interpreter with `-m pipeline`."""
    from pathlib import Path

    if Path(sys.argv[0]).name == "pipeline":
        return [sys.argv[0]]
    return [sys.executable, "-m", "pipeline"]
