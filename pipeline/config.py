"""The typed configuration tree shared by every stage.

Precedence, lowest to highest: the defaults written here < the YAML file < `key=value`
overrides on the command line. Unknown keys and wrong types are refused with a message that
names the key and what is allowed; cross-field rules are checked at load time.

Each stage receives only its own section (`cfg.train`, `cfg.data`, ...), never the root.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# raised here, defined with the others
from pipeline.errors import ConfigError  # noqa: F401
from pipeline.plan import BatchPlan, Degrees, Plan, deal_batch
from pipeline.tasks import TASKS, task_class

# runs, and what --run-id downloads, live under it
DEFAULT_OUTPUT_DIR = "outputs"


class Section(BaseModel):
    # extra="forbid" is what turns a typo such as `optim.lrr` into an error instead of a no-op.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# `model.name` / `data.name` shorthands for the built-in components (pipeline/models,
# pipeline/datasets).
BUILTIN_MODELS = {"resnet18": "pipeline.models:resnet18", "mlp": "pipeline.models:mlp"}
BUILTIN_DATA = {
    "digits": "pipeline.datasets:digits",
    "fashion_mnist": "pipeline.datasets:fashion_mnist",
    "synthetic": "pipeline.datasets:synthetic",
    "sharded": "pipeline.datasets:sharded",
}


class ComponentSection(Section):
    """A `component: "module.path:attribute"` reference and the keyword `args` it is called with."""

    KEY: ClassVar[str] = ""

    @field_validator("component", check_fields=False)
    @classmethod
    def _reference(cls, value: str | None) -> str | None:
        if value:
            from pipeline.components.reference import split_reference

            split_reference(cls.KEY, value)
        return value


def _shorthand(data: Any, key: str, builtin: dict[str, str]) -> Any:
    """`name: X` stands for `component: <built-in X>`; naming another component as well contradicts
    it."""
    if not isinstance(data, dict) or data.get("name") is None or data["name"] not in builtin:
        # an unknown name is refused by the field's Literal, with the allowed ones
        return data
    wanted = builtin[data["name"]]
    if data.get("component") not in (None, wanted):
        raise ValueError(
            f"{key}.name={data['name']} means {key}.component={wanted}, but {key}.component="
            f"{data['component']} is set too; keep one of them"
        )
    return {**data, "component": wanted}


class DataConfig(ComponentSection):
    KEY: ClassVar[str] = "data"
    component: str = Field(
        "pipeline.datasets:digits",
        description="'module.path:attribute' of a callable(**args) -> {'train': Dataset, 'val': Dataset}.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the data component."
    )
    name: Literal["digits", "fashion_mnist", "synthetic", "sharded"] | None = Field(
        None,
        description="Shorthand for a built-in data set: digits (offline), fashion_mnist (IDX files in args.path), "
        "synthetic, sharded (Parquet shards `pipeline data shard` wrote, in args.root: streamed).",
    )
    num_workers: int = Field(
        0,
        ge=0,
        description="DataLoader worker processes per rank (0 = load in the training process).",
    )

    @model_validator(mode="before")
    @classmethod
    def _name(cls, data: Any) -> Any:
        return _shorthand(data, "data", BUILTIN_DATA)


class ModelConfig(ComponentSection):
    KEY: ClassVar[str] = "model"
    component: str = Field(
        "pipeline.models:resnet18",
        description="'module.path:attribute' of a callable(**args) -> torch.nn.Module.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the model; those it takes and args omits come "
        "from the training set (num_classes from `classes`, its `model_args`).",
    )
    name: Literal["resnet18", "mlp"] | None = Field(
        None, description="Shorthand for a built-in model: resnet18, mlp."
    )

    @model_validator(mode="before")
    @classmethod
    def _name(cls, data: Any) -> Any:
        return _shorthand(data, "model", BUILTIN_MODELS)


class ComponentConfig(ComponentSection):
    component: str = Field(
        description="'module.path:attribute': a class (instantiated with args) or a function "
        "(called with args on every use)."
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for it.")


class LossConfig(ComponentConfig):
    KEY: ClassVar[str] = "task.loss"


class MetricConfig(ComponentConfig):
    KEY: ClassVar[str] = "task.metric"


class TaskConfig(Section):
    name: str = Field(
        "classification",
        description="The task (pipeline/tasks): classification (cross-entropy; accuracy, top-k; exports "
        "the model's outputs and probabilities), regression (MSE; RMSE, MAE, R2), "
        "segmentation (per-pixel cross-entropy; mean IoU, pixel accuracy; N x C x H x W "
        "logits), token_classification (per-token cross-entropy; macro F1, token accuracy; "
        "N x L x C logits, N x L targets), or custom (task.loss, task.metric on the outputs "
        "and targets as they are).",
    )
    output: str = Field(
        "",
        description="The model output that carries the prediction, when the model returns several "
        "(a dict key, a ModelOutput field, output_<i> of a tuple); empty = the only one, "
        "else `logits` for the tasks that predict classes.",
    )
    loss: LossConfig | None = Field(
        None,
        description="A loss component (outputs, target) -> scalar: required for custom, replaces the built-in loss otherwise.",
    )
    metric: MetricConfig | None = Field(
        None,
        description="custom only: a metric component (outputs, targets) -> float or {name: float}, the first being the one gated.",
    )
    metric_mode: Literal["max", "min"] | None = Field(
        None,
        description="custom only: whether a larger metric is better (max) or a smaller one (min).",
    )
    top_k: int = Field(
        5,
        ge=2,
        description="classification: also report top-k accuracy when k is below the number of classes.",
    )
    ignore_index: int | None = Field(
        None,
        description="token_classification: the target value of the positions left out "
        "of the loss and the metrics (padding); unset = -100, as Hugging Face "
        "labels them. Negative.",
    )

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in TASKS:
            close = difflib.get_close_matches(value, list(TASKS), n=1)
            raise ValueError(
                f"'{value}' is not a task; choose one of {', '.join(TASKS)}"
                + (f" (did you mean '{close[0]}'?)" if close else "")
            )
        return value

    @model_validator(mode="after")
    def _task_rules(self) -> "TaskConfig":
        # each task's own cross-field rules
        task_class(self.name).check_config(self)
        return self


class OptimConfig(Section):
    name: Literal["sgd", "adamw"] = Field("sgd", description="Optimizer.")
    lr: float = Field(
        0.1, gt=0, description="Peak learning rate, reached at the end of the warm-up."
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum (Nesterov).")
    weight_decay: float = Field(
        5e-4, ge=0, description="Decoupled (AdamW) or L2 (SGD) weight decay."
    )
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(
        0, ge=0, description="Linear warm-up from 0 to `lr` over this many optimizer steps."
    )
    schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="Learning-rate shape after the warm-up."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of `lr`.")


class EarlyStoppingConfig(Section):
    patience: int = Field(
        0,
        ge=0,
        description="Stop after this many evaluations without an improvement of checkpoint.monitor by more than min_delta; 0 = never stop early.",
    )
    min_delta: float = Field(
        0.0,
        ge=0,
        description="The smallest change of the monitored metric that counts as an improvement.",
    )


class ParallelConfig(Section):
    dp_replicate: int = Field(
        1,
        ge=1,
        description="HSDP: replicas of the model, each sharded over dp_shard ranks (FSDP2 on a 2-D device mesh: gradients reduce-scattered within a replica, all-reduced across replicas); >1 needs train.strategy=fsdp.",
    )
    dp_shard: int = Field(
        0,
        ge=0,
        description="Ranks each replica's parameters are sharded over; 0 = what the world size leaves, world / (dp_replicate x tp x pp).",
    )
    tp: int = Field(
        1,
        ge=1,
        description="Tensor-parallel degree: the model's attention and MLP projections split over this many neighbouring ranks (DTensor parallelize_module; the model's own tensor_parallel_plan(), or a family known by its module names: BERT-style, LLaMA-style). With data-parallel ranks beside it, train.strategy=fsdp.",
    )
    pp: int = Field(
        1,
        ge=1,
        description="Pipeline-parallel degree: the model cut into this many stages, one a rank (torch.distributed.pipelining's tracer: the model must be one torch.export graph), micro-batches streamed through them. With data-parallel ranks beside it, train.strategy=ddp (each stage's copies).",
    )
    pp_split: list[str] = Field(
        default_factory=list,
        description="With pp: the pp-1 modules where stages 2..pp begin, in forward order (e.g. [encoder.layers.1]); empty = the model's repeated block dealt evenly over the stages.",
    )
    pp_schedule: Literal["1f1b", "gpipe"] = Field(
        "1f1b",
        description="With pp: 1F1B (a backward as soon as a micro-batch's forward is done: activations of at most pp micro-batches held) or GPipe (all forwards, then all backwards).",
    )
    pp_microbatches: int = Field(
        0,
        ge=0,
        description="With pp: micro-batches each rank's batch is cut into (it must divide the batch); 0 = 2 x pp. More shrinks the pipeline's idle bubble, (pp-1)/(microbatches+pp-1) of a step.",
    )

    def microbatches(self) -> int:
        """The micro-batches of each rank's batch under pipeline parallelism (pp_microbatches; 0 =
        2 x pp)."""
        return self.pp_microbatches or 2 * self.pp

    def degrees(self, world_size: int) -> Degrees:
        """The degrees with dp_shard resolved; ConfigError when their product is not the world.
        config.check_runtime is their one caller: the run reads them from its Plan."""
        others = self.dp_replicate * self.tp * self.pp
        shard = self.dp_shard or world_size // others
        if shard < 1 or others * shard != world_size:
            raise ConfigError(
                f"train.parallel: dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard or shard} x tp "
                f"{self.tp} x pp {self.pp} = {others * max(shard, 1)}, but the world has {world_size} "
                f"processes; their product must be the world size (dp_shard=0 takes what the others leave)"
            )
        return Degrees(self.dp_replicate, shard, self.tp, self.pp)


class TrainConfig(Section):
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="DistributedDataParallel, or FSDP2 fully_shard."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = CUDA when present, else CPU."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="auto = bf16 on CUDA with bf16 support, fp16 on older CUDA, bf16 on a CPU with native bf16 matmul (AMX/AVX512-BF16), else fp32.",
    )
    global_batch_size: int = Field(
        64,
        ge=1,
        description="Samples per optimizer step, summed over ranks and accumulation steps.",
    )
    grad_accum_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step on each rank."
    )
    max_steps: int = Field(0, ge=0, description="Optimizer steps to train; 0 = use `epochs`.")
    epochs: int = Field(10, ge=1, description="Passes over the training set when max_steps is 0.")
    clip_grad_norm: float = Field(
        0.0, ge=0, description="Clip the global gradient norm to this (after unscaling); 0 = off."
    )
    sync_batchnorm: bool = Field(
        False, description="Convert BatchNorm to SyncBatchNorm (statistics over all ranks)."
    )
    seed: int = Field(
        0,
        description="Seed for model init and shuffling; same seed, same losses (bit for bit on CPU).",
    )
    log_every: int = Field(10, ge=1, description="Log training metrics every N optimizer steps.")
    eval_every: int = Field(
        0,
        ge=0,
        description="Evaluate every N optimizer steps; 0 = once per epoch (every steps-per-epoch steps). Always at the end.",
    )
    early_stopping: EarlyStoppingConfig = Field(
        default_factory=EarlyStoppingConfig,
        description="Stop every rank together when the monitored validation metric stops improving.",
    )
    consistency_every: int = Field(
        50, ge=0, description="Compare replica checksums every N steps (DDP); 0 = only at the end."
    )
    threads_per_rank: int = Field(
        0,
        ge=0,
        description="torch CPU threads per rank; 0 = the usable cores divided by local ranks.",
    )
    cudnn_benchmark: bool = Field(
        True, description="CUDA only: let cuDNN pick the fastest kernels for fixed shapes."
    )
    channels_last: bool | Literal["auto"] = Field(
        "auto",
        description="CUDA only: NHWC memory format (faster convolutions with tensor cores): the inputs, and the weights under DDP (FSDP2 keeps them contiguous). auto = on for a model with 2-d convolutions (ResNet-50 bf16 on an H100: 1.3-1.4x the samples/s of NCHW), off otherwise and on the CPU.",
    )
    compile: bool = Field(
        False,
        description="torch.compile the model (in place: DDP as a whole, FSDP2 per unit); the first steps compile. On CUDA it needs a C compiler for Triton.",
    )
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="The device mesh's degrees, as torchtitan names them; their product is the world size.",
    )
    fsdp_wrap: list[str] = Field(
        default_factory=list,
        description="strategy=fsdp: class names of the modules to shard as units (e.g. [TransformerEncoderLayer]); "
        "empty = the class repeated most in the largest ModuleList/Sequential.",
    )
    output_dir: str = Field(
        DEFAULT_OUTPUT_DIR,
        description="Where runs write checkpoints and local artifacts: <output_dir>/<run_name>/. A local path every rank shares, or an object store, s3://<bucket>/<prefix> (pip install -e '.[remote]'; endpoint and keys from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).",
    )
    run_name: str = Field(
        "",
        description="Local run directory name and MLflow run name; empty = <model>-<data>-<timestamp> (or torchrun's run id), named after the components.",
    )

    @field_validator("output_dir")
    @classmethod
    def _store_url(cls, value: str) -> str:
        # s3://bucket/prefix: its form and s3fs checked here; credentials and the bucket when
        # training starts.
        from pipeline.checkpoint import object_store

        return str(object_store.check_url(value)) if object_store.is_url(value) else value


class CheckpointConfig(Section):
    every_n_steps: int = Field(
        0,
        ge=0,
        description="Save a sharded checkpoint every N optimizer steps; 0 = only at the end.",
    )
    keep_last: int = Field(
        2,
        ge=1,
        description="Complete checkpoints kept on disk; older ones are deleted after a newer one completes.",
    )
    log_to_mlflow: Literal["none", "last", "all"] = Field(
        "last",
        description="Which checkpoints go to the MLflow run: the final one (and the best, when another), or each as it is written (uploaded in the background).",
    )
    monitor: str = Field(
        "",
        description="The validation metric that picks the best checkpoint (e.g. accuracy, val/loss); empty = the task's primary metric. The best is saved when it is reached, never pruned, and what consolidate/export take.",
    )
    mode: Literal["auto", "max", "min"] = Field(
        "auto",
        description="Whether a larger monitored metric is better (max) or a smaller one (min); auto = known for the task's metrics.",
    )
    async_save: bool = Field(
        False,
        description="Write checkpoints in the background (DCP async_save): training goes on once the state is copied to CPU memory (pinned on CUDA); the checkpoint is published, atomically as ever, once every rank's write is done.",
    )


class TrackingConfig(Section):
    tracking_uri: str = Field(
        "",
        description="MLflow tracking URI; empty = $MLFLOW_TRACKING_URI, else ./mlflow.db (SQLite) with artifacts in ./mlartifacts.",
    )
    experiment: str = Field("trainserve", description="MLflow experiment name.")
    system_metrics: bool = Field(
        True, description="Log MLflow system metrics (CPU, memory, GPU) during training."
    )


class ExportConfig(Section):
    opset: int = Field(
        18, ge=13, description="ONNX opset; 18 is what torch's dynamo exporter targets natively."
    )
    registered_model_name: str = Field(
        "",
        description="Registry name; empty = <model>-<data> from the components' names (e.g. resnet18-digits).",
    )
    alias: str = Field(
        "champion",
        description="Alias set on the new version when every gate passes and `promote` allows it.",
    )
    promote: Literal["if_better", "if_not_worse", "always"] = Field(
        "if_not_worse",
        description="Move `alias` to the new version when its metric (the task's primary, through onnxruntime on the validation split) beats the current holder's (if_better), is no worse (if_not_worse), or always.",
    )
    promote_tolerance: float = Field(
        0.0,
        ge=0,
        description="In the metric's units: if_better needs a gain larger than this; if_not_worse allows a loss up to this.",
    )
    challenger_alias: str = Field(
        "challenger",
        description="Alias set on a version that passed its gates but was not promoted.",
    )
    # A new contract under the same name breaks every client of the alias: said, and not done unless
    # asked.
    allow_contract_change: bool = Field(
        False,
        description="Let a model whose input/output contract (input and output names, dtypes and shapes apart from dynamic axes, the task, which outputs carry the decision and the prediction, the class labels) differs from the alias holder's take the alias; without it such a model is registered under `challenger_alias` and the log names every difference. Better: a new `registered_model_name` for a new contract.",
    )
    atol: float = Field(
        1e-4,
        gt=0,
        description="Parity gate: |ONNX - PyTorch| outputs <= atol + rtol x the sample's largest |output| (fp32).",
    )
    rtol: float = Field(1e-3, gt=0, description="Parity gate: the relative part of that limit.")
    accuracy_tolerance_pp: float = Field(
        0.1,
        ge=0,
        description="classification: ONNX accuracy within this many percentage points of PyTorch's.",
    )
    metric_rtol: float = Field(
        1e-3,
        ge=0,
        description="regression (RMSE) and custom tasks: |ONNX - PyTorch| metric <= metric_atol + metric_rtol x |PyTorch|.",
    )
    baseline_margin: float = Field(
        0.05,
        ge=0,
        description="Baseline gate: the model must beat the task's trivial predictor (the most frequent class, the mean) by this much: points of a fraction metric (0.05 = 5 points of accuracy), or this fraction of an error (5% lower RMSE).",
    )
    allow_below_baseline: bool = Field(
        False,
        description="Register a model the baseline gate finds no better than the trivial predictor (it is still recorded as below the baseline, and `pipeline run --serve-check` exits 1).",
    )
    metric_atol: float = Field(
        1e-6, ge=0, description="The absolute part of that limit, for a metric near 0."
    )
    dynamic_axes: dict[str, list[int]] = Field(
        default_factory=dict,
        description="Input name -> axes besides the batch that vary, e.g. {tokens: [1]} (a lone tensor input is named input).",
    )
    external_data: Literal["auto", "always"] = Field(
        "auto",
        description="Where the graph's weights go: auto = inside model.onnx, unless they pass protobuf's 2 GB limit; always = in model.onnx.data beside it (ONNX external data), whatever their size.",
    )
    ort_optimize: bool = Field(
        False, description="Also save onnxruntime's offline-optimized graph (gated separately)."
    )
    fp16: bool = Field(
        False,
        description="Also save an fp16 variant for GPU serving, fp32 inputs/outputs kept (gated separately).",
    )
    uint8_inputs: list[str] = Field(
        default_factory=list,
        description="Also save a variant (model.uint8.onnx, served with --variant uint8) that takes these FP32 image inputs as UINT8 pixel values 0-255, scaled by 1/255 inside the graph: a quarter of the bytes a request (150 KB instead of 602 KB for 224x224 RGB). true = every FP32 input. The validation data must lie in [0, 1]; gated separately (its failure fails the export): parity on inputs rounded to 1/255 steps, and what that rounding costs the task's metric.",
    )
    int8: Literal["off", "auto", "static", "dynamic"] = Field(
        "off",
        description="Also save an int8 variant for CPU serving (gated separately, and only that variant is dropped when it fails): static = activations calibrated on training samples (convolutions), dynamic = activations quantized per batch at run time (linear-heavy models: transformers, MLPs), auto (or true) = static when the graph has a Conv, else dynamic; false = off.",
    )
    int8_accuracy_tolerance_pp: float = Field(
        1.0,
        ge=0,
        description="int8, class-predicting tasks: its accuracy (mean IoU) within this many percentage points of PyTorch's.",
    )
    int8_metric_rtol: float = Field(
        0.02,
        ge=0,
        description="int8, other tasks: |int8 - PyTorch| metric <= metric_atol + this x |PyTorch|.",
    )
    int8_min_agreement: float = Field(
        0.98,
        ge=0,
        le=1,
        description="int8, class-predicting tasks: the share of argmax decisions that must equal PyTorch's.",
    )
    int8_calibration_samples: int = Field(
        256,
        ge=1,
        description="int8 static: training samples its activation ranges are calibrated on.",
    )
    int8_exclusion_rounds: int = Field(
        3,
        ge=0,
        description="int8: when a gate fails, rounds of measuring each quantized node's error and keeping the worst in float (the report names them); 0 = reject at once.",
    )

    @field_validator("uint8_inputs", mode="before")
    @classmethod
    def _uint8_inputs(cls, value):
        # `export.uint8_inputs=true` (every FP32 input), false, one name, or a list of names.
        if isinstance(value, bool):
            return ["*"] if value else []
        return [value] if isinstance(value, str) else value

    @field_validator("int8", mode="before")
    @classmethod
    def _int8_bool(cls, value):
        # YAML and `export.int8=true` give a bool: true asks for the variant, the graph picks the
        # kind.
        return {True: "auto", False: "off"}.get(value, value) if isinstance(value, bool) else value


class ServeConfig(Section):
    host: str = Field(
        "127.0.0.1",
        description="Bind address; 127.0.0.1 unless the server must be reachable from outside.",
    )
    port: int = Field(
        8080, ge=0, le=65535, description="HTTP port (`pipeline run --serve`); 0 = any free port."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Execution provider: CUDA when present and asked for, else CPU."
    )
    max_batch_size: int = Field(32, ge=1, description="Rows per onnxruntime call at most.")
    max_delay_ms: float = Field(
        0.0, ge=0, description="How long a partial batch may wait for more rows; 0 = never wait."
    )


class Config(Section):
    data: DataConfig = Field(default_factory=DataConfig, description="What to train on.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="What to train.")
    task: TaskConfig = Field(
        default_factory=TaskConfig, description="What is learned: loss, metrics, exported outputs."
    )
    optim: OptimConfig = Field(
        default_factory=OptimConfig, description="Optimizer and learning-rate schedule."
    )
    train: TrainConfig = Field(
        default_factory=TrainConfig, description="The training loop and its distribution."
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Sharded checkpoints."
    )
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    export: ExportConfig = Field(
        default_factory=ExportConfig, description="ONNX export and its gates."
    )
    serve: ServeConfig = Field(default_factory=ServeConfig, description="Inference server.")

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "Config":
        if self.train.precision == "fp16" and self.train.device == "cpu":
            raise ValueError(
                "train.precision=fp16 needs CUDA (GradScaler and fp16 kernels); on CPU use "
                "train.precision=bf16 or train.precision=auto"
            )
        if self.data.component == "pipeline.datasets:fashion_mnist" and not self.data.args.get(
            "path"
        ):
            raise ValueError(
                "the fashion_mnist data set needs data.args.path=<directory with the four IDX files>"
            )
        unknown_axes = [
            k for k, axes in self.export.dynamic_axes.items() if any(a < 1 for a in axes)
        ]
        if unknown_axes:
            raise ValueError(
                f"export.dynamic_axes: axes must be >= 1 (axis 0, the batch, is always dynamic); "
                f"see {', '.join(unknown_axes)}"
            )
        return self


def check_pipeline(t: TrainConfig, degrees: Degrees, batch: BatchPlan) -> None:
    """What pipeline parallelism does not combine with yet, and a batch its micro-batches divide."""
    pp = degrees.pp
    refused = {
        "train.parallel.tp": ("train.parallel.tp=1", degrees.tp > 1),
        "train.compile": ("train.compile=false", t.compile),
        "train.precision=fp16": ("train.precision=bf16 or fp32", t.precision == "fp16"),
        "train.sync_batchnorm": ("train.sync_batchnorm=false", t.sync_batchnorm),
        "train.strategy=fsdp beside data-parallel ranks": (
            "train.strategy=ddp",
            t.strategy == "fsdp" and batch.data_parallel > 1,
        ),
    }
    named = [(name, instead) for name, (instead, on) in refused.items() if on]
    if named:
        raise ConfigError(
            f"train.parallel.pp={pp} with {', '.join(n for n, _ in named)}: not built yet (pipeline stages "
            "run as traced graphs, with DDP over each stage's data-parallel copies, in fp32 or bf16); "
            f"set {', '.join(i for _, i in named)}"
        )
    if batch.rows % batch.microbatches:
        raise ConfigError(
            f"train.parallel.pp={pp}: each rank's batch of {batch.rows} rows (global_batch_size "
            f"{t.global_batch_size} / {batch.data_parallel} data-parallel rank(s) / "
            f"grad_accum_steps {t.grad_accum_steps}) does not split into {batch.microbatches} "
            "equal micro-batches "
            f"(train.parallel.pp_microbatches{'=0: 2 x pp' if not t.parallel.pp_microbatches else ''}); "
            "choose pp_microbatches dividing it, or a global_batch_size it divides"
        )
    if t.parallel.pp_schedule == "1f1b" and batch.microbatches < pp:
        raise ConfigError(
            f"train.parallel.pp_schedule=1f1b needs at least as many micro-batches as stages: "
            f"pp_microbatches={batch.microbatches} < pp={pp}; raise pp_microbatches or use "
            "pp_schedule=gpipe"
        )


def check_runtime(
    cfg: Config, world_size: int, cuda_available: bool, local_world_size: int = 1
) -> Plan:
    """Rules that depend on the launch, checked before any work starts. Returns what the run
    derives from them, the mesh's degrees and the batch plan, which nothing works out again."""
    t = cfg.train
    if cuda_available and t.device != "cpu":
        import torch

        cuda_devices = torch.cuda.device_count()
        if local_world_size > cuda_devices:
            raise ConfigError(
                f"{local_world_size} processes per node but {cuda_devices} visible GPU(s): one GPU "
                f"per rank; use --nproc-per-node {cuda_devices} or train.device=cpu"
            )
    if t.precision == "fp16" and not (cuda_available and t.device != "cpu"):
        raise ConfigError(
            "train.precision=fp16 needs a CUDA device and none is in use; "
            "use train.precision=bf16 (CPU autocast) or train.precision=auto"
        )
    if t.device == "cuda" and not cuda_available:
        raise ConfigError(
            "train.device=cuda but torch sees no CUDA device; use train.device=auto or cpu"
        )
    degrees = t.parallel.degrees(world_size)
    if degrees.tp > 1 and t.compile:
        raise ConfigError(
            f"train.compile with train.parallel.tp={degrees.tp}: compiling a tensor-parallel model "
            "is not built yet; set train.compile=false"
        )
    if degrees.tp > 1 and degrees.data_parallel > 1 and t.strategy != "fsdp":
        raise ConfigError(
            f"train.parallel.tp={degrees.tp} beside {degrees.data_parallel} data-parallel ranks "
            "needs train.strategy=fsdp (FSDP2 composes with tensor-parallel DTensors; DDP does not)"
        )
    if degrees.dp_replicate > 1 and t.strategy != "fsdp":
        raise ConfigError(
            f"train.parallel.dp_replicate={degrees.dp_replicate} shards each replica over "
            f"dp_shard={degrees.dp_shard} ranks: that is HSDP, set train.strategy=fsdp (DDP "
            "replicates over every rank already)"
        )
    # Without a pipeline each rank's batch is one micro-batch, whatever pp_microbatches says.
    microbatches = t.parallel.microbatches() if degrees.pp > 1 else 1
    batch = deal_batch(t.global_batch_size, t.grad_accum_steps, degrees, microbatches)
    if degrees.pp > 1:
        check_pipeline(t, degrees, batch)
    return Plan(degrees, batch)


# --- loading -------------------------------------------------------------------------------


def _allowed_keys(model_cls: type[BaseModel]) -> list[str]:
    return sorted(model_cls.model_fields)


def _unknown_key_message(dotted: str, origin: str = "") -> str:
    """`origin`: where the key was written ("my.yaml:12", "override train.epoch=3"), put first as a
    compiler does."""
    origin = f"{origin}: " if origin else ""
    parts = dotted.split(".")
    cls: type[BaseModel] = Config
    for i, part in enumerate(parts):
        fields = cls.model_fields
        if part not in fields:
            prefix = ".".join(parts[:i])
            allowed = _allowed_keys(cls)
            close = difflib.get_close_matches(part, allowed, n=1)
            hint = (
                f" Did you mean '{(prefix + '.' if prefix else '') + close[0]}'?" if close else ""
            )
            # a component's own arguments live under args
            if not close and "args" in fields:
                hint = f" Did you mean '{prefix}.args.{part}' (the component's keyword arguments go under args)?"
            where = f"in section '{prefix}'" if prefix else "at the top level"
            return f"{origin}unknown config key '{dotted}' {where}.{hint} Allowed: {', '.join(allowed)}"
        annotation = fields[part].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            cls = annotation
    return f"{origin}unknown config key '{dotted}'"


def _format_validation_error(
    err: ValidationError, origin: "Callable[[tuple], str]" = lambda loc: ""
) -> str:
    """One line for one error (the usual case: what the CLI prints after "error: "), else one line
    each. `origin(loc)`: where the key at `loc` was written, '' if nowhere (a default, a rule across
    fields)."""
    lines = []
    for e in err.errors():
        dotted = ".".join(str(p) for p in e["loc"])
        where = origin(tuple(str(p) for p in e["loc"]))
        if e["type"] == "extra_forbidden":
            lines.append(_unknown_key_message(dotted, where))
        elif e["type"] == "value_error":
            lines.append(
                (f"{where}: " if where else "")
                + (str(e["ctx"]["error"]) if "ctx" in e else e["msg"])
            )
        else:
            got = e.get("input")
            lines.append((f"{where}: " if where else "") + f"{dotted}: {e['msg']} (got {got!r})")
    return (
        "invalid config: " + lines[0]
        if len(lines) == 1
        else "invalid config:\n  " + "\n  ".join(lines)
    )


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """{('train', 'epoch'): 5}: the line (from 1) of every key of a YAML file's mapping tree."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    lines[(*prefix, str(key.value))] = key.start_mark.line + 1
                    walk(value, (*prefix, str(key.value)))

    try:
        walk(yaml.compose(text, Loader=yaml.SafeLoader), ())
    except yaml.YAMLError:
        # it loaded; its lines are a courtesy
        pass
    return lines


def _origin_of(
    path: Path | None, text: str, overrides: list[tuple[list[str], str]]
) -> Callable[[tuple], str]:
    """loc -> where the key was written: the override that set it or the section above it (the
    command line wins, as it does over the file), else the file and the line of its nearest key."""
    lines = _key_lines(text) if path is not None else {}

    def origin(loc: tuple) -> str:
        in_file = next(
            (loc[:depth] for depth in range(len(loc), 0, -1) if loc[:depth] in lines), None
        )
        for keys, original in reversed(overrides):
            keys = tuple(keys)
            # it set the key, or made it
            if loc[: len(keys)] == keys or (keys[: len(loc)] == loc and in_file != loc):
                return f"override {original}"
        return f"{path}:{lines[in_file]}" if in_file else ""

    return origin


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.lr=0.05` -> (['optim', 'lr'], 0.05). The value is read as YAML, so types follow."""
    if "=" not in text:
        raise ConfigError(
            f"override '{text}' is not of the form section.key=value (e.g. optim.lr=0.05)"
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(
            f"override '{text}' has an empty key; write section.key=value (e.g. optim.lr=0.05)"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{text}': value is not valid YAML ({exc.problem})") from None
    return key.split("."), value


def _set_dotted(tree: dict, path: list[str], value: Any, original: str) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"override '{original}': '{'.'.join(path[: i + 1])}' is a value, not a section"
            )
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults < YAML file < overrides. Raises ConfigError with a message meant for a human."""
    tree: dict = {}
    text = ""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            available = (
                sorted(str(p) for p in Path("configs").glob("*.yaml"))
                if Path("configs").is_dir()
                else []
            )
            hint = f"; available: {', '.join(available)}" if available else ""
            raise ConfigError(f"config file '{path}' does not exist{hint}")
        try:
            text = path.read_text()
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{path}' is not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(
                f"config file '{path}' must hold a mapping of sections, got {type(tree).__name__}"
            )
    applied: list[tuple[list[str], str]] = []
    for override in overrides:
        keys, value = parse_override(override)
        _set_dotted(tree, keys, value, override)
        applied.append((keys, override))
        if (
            len(keys) == 2
            and keys[1] in ("name", "component")
            and isinstance(tree.get(keys[0]), dict)
        ):
            # `model.component=...` on the command line replaces the file's `model.name` shorthand
            # (and the other way round): the command line wins, as everywhere else.
            tree[keys[0]].pop("component" if keys[1] == "name" else "name", None)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, _origin_of(path, text, applied))) from None


def config_from_dict(tree: dict) -> Config:
    """Rebuild a config saved with a run or a checkpoint (same validation as a file)."""
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def flatten(cfg: BaseModel | dict, prefix: str = "") -> dict[str, Any]:
    """{'optim.lr': 0.1, 'model.args.width': 0.5, ...}: the form MLflow params take."""
    out: dict[str, Any] = {}
    items = (
        cfg.items()
        if isinstance(cfg, dict)
        else ((n, getattr(cfg, n)) for n in type(cfg).model_fields)
    )
    for name, value in items:
        key = f"{prefix}{name}"
        if isinstance(value, (BaseModel, dict)) and value:
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def describe() -> str:
    """Every field with its default and comment, for `pipeline config --describe` and the README."""
    lines = []

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, field in cls.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                lines.append(f"\n[{prefix}{name}] {field.description}")
                walk(ann, f"{prefix}{name}.")
            else:
                default = field.default_factory() if field.default_factory else field.default
                lines.append(f"  {prefix}{name} = {default!r}  # {field.description}")

    walk(Config, "")
    return "\n".join(lines).lstrip()
