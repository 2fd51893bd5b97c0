"""Sharded data: splits written as Parquet shards with a manifest (format.py), streamed to training
ranks and their loader workers with an exact, world-size-free position (stream.py), written from any
data component by `pipeline data shard` (pipeline/data_cli.py), read by the data component
`pipeline.datasets:sharded`."""
