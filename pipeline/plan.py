"""What a training run derives from train.* and the world size, worked out once before anything
starts.

    Degrees    the device mesh's degrees (ParallelConfig.degrees resolves dp_shard)
    BatchPlan  train.global_batch_size dealt over the data-parallel ranks, the accumulation steps
               and the pipeline's micro-batches (deal_batch)
    Plan       both: what config.check_runtime returns to train.main

The mesh, the loaders, the pipeline's schedule and the loss read these; none divides the batch
again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pipeline.errors import ConfigError


@dataclass(frozen=True)
class Degrees:
    """The device mesh's degrees, as torchtitan names them; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int

    @property
    def data_parallel(self) -> int:
        """The ranks the data is dealt over: the replicas times the shards of each."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def needs_mesh(self) -> bool:
        """More than data parallelism over every rank: replicas, tensor or pipeline parallelism."""
        return not self.dp_replicate == self.tp == self.pp == 1

    def named(self) -> dict[str, int]:
        """{dp_replicate, dp_shard, tp, pp}, in the mesh's order (outermost last)."""
        return asdict(self)


@dataclass(frozen=True)
class BatchPlan:
    """One optimizer step's samples as the ranks read them.

    Each of the `data_parallel` ranks reads `rows` samples `accumulation` times a step; under
    pipeline parallelism each read is cut into `microbatches` equal micro-batches (1 otherwise).
    The ranks of a tensor-parallel group or of a pipeline read the same rows.
    """

    rows: int
    data_parallel: int = 1
    accumulation: int = 1
    microbatches: int = 1

    @property
    def global_batch_size(self) -> int:
        """train.global_batch_size: every data-parallel rank's rows, every accumulation step."""
        return self.rows * self.data_parallel * self.accumulation

    @property
    def rows_per_step(self) -> int:
        """What one rank reads for one optimizer step."""
        return self.rows * self.accumulation

    @property
    def micro_rows(self) -> int:
        """A pipeline micro-batch: the rows its stages are traced at."""
        return self.rows // self.microbatches

    @property
    def pieces(self) -> int:
        """The pieces one rank's step is cut into (micro-batches x accumulation steps): each piece's
        loss is divided by their number, so the gradients summed over them are the mean."""
        return self.microbatches * self.accumulation


@dataclass(frozen=True)
class Plan:
    degrees: Degrees
    batch: BatchPlan


def deal_batch(
    global_batch_size: int, accumulation: int, degrees: Degrees, microbatches: int = 1
) -> BatchPlan:
    """train.global_batch_size dealt over the data-parallel ranks and the accumulation steps;
    ConfigError, with the nearest batches that divide, when it does not divide."""
    ranks = degrees.data_parallel
    dealt_over = ranks * accumulation
    if global_batch_size % dealt_over:
        lower = (global_batch_size // dealt_over) * dealt_over or dealt_over
        world = degrees.world_size
        named = (
            f"world size ({world})"
            if ranks == world
            else f"the data-parallel ranks ({ranks} = world size {world} / tp {degrees.tp} / "
            f"pp {degrees.pp})"
        )
        raise ConfigError(
            f"train.global_batch_size={global_batch_size} must divide by {named} x "
            f"train.grad_accum_steps ({accumulation}) = {dealt_over}; "
            f"try train.global_batch_size={lower} or {lower + dealt_over}"
        )
    return BatchPlan(global_batch_size // dealt_over, ranks, accumulation, microbatches)
