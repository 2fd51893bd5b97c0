"""The model contract in its pure pieces: outputs named as the model returns them, the prediction
found or the fix named, targets of any structure, segmentation's metrics and per-pixel decisions,
parity per output. The end-to-end runs of the same models (a transformers classifier, a timm-shaped
factory, two heads with a dict target, segmentation) are in test_own_models.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipeline.artifact import gates
from pipeline.components.data import DataError
from pipeline.config import ConfigError, config_from_dict
from pipeline.distributed import DistInfo
from pipeline.errors import TaskError
from pipeline.tasks import TASKS, build_task
from pipeline.tasks.base import _interleave, layout_of
from pipeline.tasks.classification import Classification
from pipeline.tasks.regression import Regression
from pipeline.tasks.segmentation import Segmentation

WHERE = "model.component 'm' on 2 validation samples"


@dataclasses.dataclass
# a ModelOutput-like output: read as outputs.logits by a transformers-style loss
class Classified:
    logits: torch.Tensor
    embedding: torch.Tensor


@dataclasses.dataclass
# a dataclass output, as some libraries return
class Heads:
    score: torch.Tensor
    box: torch.Tensor
    aux: torch.Tensor | None = None


def test_outputs_are_named_as_the_model_returns_them():
    t = torch.zeros(2, 3)
    assert layout_of(t, "logits", WHERE).names == ("logits",)
    assert layout_of((t, t), "logits", WHERE).names == ("output_0", "output_1")
    assert layout_of([t], "logits", WHERE).names == ("output_0",)
    assert layout_of({"a": t, "b": t}, "logits", WHERE).names == ("a", "b")
    # None fields are absent
    assert layout_of(Heads(t, t), "logits", WHERE).names == (
        "score",
        "box",
    )
    from transformers.modeling_outputs import SequenceClassifierOutput

    # loss, hidden_states, attentions: None
    hf = SequenceClassifierOutput(logits=t)
    layout = layout_of(hf, "logits", WHERE)
    assert layout.names == ("logits",) and layout.flatten(hf)["logits"] is t
    assert layout_of((t, t), "logits", WHERE).rebuild({"output_0": 1, "output_1": 2}) == (1, 2)


@pytest.mark.parametrize(
    "output, expected",
    [
        ((torch.zeros(2), "x"), "whose item 1 is a str; return tensors only"),
        (
            {"logits": torch.zeros(2, 3), "hidden": (torch.zeros(2),)},
            "output 'hidden' is a tuple; every output must be a tensor",
        ),
        ({"a b": torch.zeros(2)}, "output name 'a b' must be a Python identifier"),
        (
            "text",
            "the model returned a str; return a tensor, a tuple of tensors, a dict of tensors or a ModelOutput",
        ),
    ],
)
def test_an_output_that_is_not_a_tensor_is_refused_by_name(output, expected):
    with pytest.raises(TaskError) as caught:
        layout_of(output, "logits", WHERE)
    assert expected in str(caught.value)


def classification(**task):
    cfg = config_from_dict({"task": {"name": "classification", **task}}).task
    return build_task(cfg, ["a", "b", "c"])


def test_a_classifier_finds_its_prediction_or_says_what_to_set():
    target = torch.tensor([0, 2])
    task = classification()
    task.check_output({"embedding": torch.zeros(2, 8), "logits": torch.zeros(2, 3)}, target, WHERE)
    assert task.prediction == "logits" and task.output_names == [
        "embedding",
        "logits",
        "probabilities",
    ]
    with pytest.raises(TaskError) as caught:
        classification().check_output(
            {"a": torch.zeros(2, 3), "b": torch.zeros(2, 3)}, target, WHERE
        )
    assert (
        "the model returns 2 outputs ['a', 'b']; say which one carries the classification prediction with "
        "task.output=<name> (e.g. task.output=a)" in str(caught.value)
    )
    chosen = classification(output="b")
    chosen.check_output({"a": torch.zeros(2, 8), "b": torch.zeros(2, 3)}, target, WHERE)
    assert chosen.prediction == "b"
    with pytest.raises(
        TaskError,
        match=r"task.output=c, but the model returns \['a', 'b'\]; set task.output to one",
    ):
        classification(output="c").check_output(
            {"a": torch.zeros(2, 3), "b": torch.zeros(2, 3)}, target, WHERE
        )
    with pytest.raises(
        TaskError,
        match="output 'x' is a float32 tensor of shape \\[\\] for 2 samples; every output",
    ):
        classification().check_output(
            {"logits": torch.zeros(2, 3), "x": torch.zeros(())}, target, WHERE
        )
    with pytest.raises(TaskError, match="named probabilities, which the classification task adds"):
        classification().check_output(
            {"logits": torch.zeros(2, 3), "probabilities": torch.zeros(2, 3)}, target, WHERE
        )


def test_the_task_comes_from_the_registry_and_a_wrong_name_says_which_exist():
    assert set(TASKS) == {
        "classification",
        "regression",
        "segmentation",
        "token_classification",
        "custom",
    }
    with pytest.raises(
        ConfigError,
        match="'segmentaton' is not a task; choose one of classification, regression, "
        "segmentation, token_classification, custom \\(did you mean "
        "'segmentation'\\?\\)",
    ):
        config_from_dict({"task": {"name": "segmentaton"}})
    with pytest.raises(
        ConfigError, match="task.name=custom needs task.loss, task.metric, task.metric_mode"
    ):
        config_from_dict({"task": {"name": "custom"}})


def test_segmentation_mean_iou_and_pixel_accuracy_by_hand():
    task = Segmentation(["bg", "x", "y"])
    # 1 x 2 x 2
    target = torch.tensor([[[0, 0], [1, 1]]])
    # one bg pixel called x
    predicted = torch.tensor([[[0, 1], [1, 1]]])
    logits = torch.nn.functional.one_hot(predicted, 3).permute(0, 3, 1, 2).float() * 5
    task.check_output(logits, target, WHERE)
    state = task.new_state(torch.device("cpu"))
    task.update(state, {"logits": logits}, target)
    task.reduce(state, DistInfo.cpu_alone())
    metrics = task.metrics(state)
    # bg: 1 hit, union 2 -> 0.5; x: 2 hits, union 3 -> 2/3; y absent from both: not counted
    assert metrics["mean_iou"] == pytest.approx((0.5 + 2 / 3) / 2)
    assert metrics["pixel_accuracy"] == pytest.approx(0.75)
    with pytest.raises(
        TaskError, match="must be \\(batch, classes, H, W\\) for masks of shape \\[1, 2, 2\\]"
    ):
        Segmentation(["bg", "x", "y"]).check_output(torch.zeros(1, 3, 2, 3), target, WHERE)
    with pytest.raises(
        DataError, match="segmentation needs an H x W int64 tensor of class indices per sample"
    ):
        Segmentation.check_target(torch.zeros(2, 2), None, "item 0")
    with pytest.raises(DataError, match="the mask holds class indices 0..3, outside 0..2"):
        Segmentation.check_target(torch.tensor([[0, 3]]), ["bg", "x", "y"], "item 0")


def test_decisions_are_compared_per_pixel_not_flattened():
    """N x C x H x W: the argmax over the classes (axis 1) at each pixel. Flattening each sample
    first, as the gates once did, compares one argmax over C*H*W values and misses a flipped
    pixel."""
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(4, 3, 5, 5)).astype(np.float32)
    got = ref.copy()
    # flip one pixel's decision, far from the sample's largest value
    n, h, w = 2, 1, 3
    got[n, :, h, w] = (
        ref[n, ::-1, h, w] if ref[n, :, h, w].argmax() != 1 else np.roll(ref[n, :, h, w], 1)
    )
    result = gates.compare({"logits": got}, {"logits": ref}, atol=10, rtol=0, decision="logits")
    assert result["argmax_agreement"] == pytest.approx(1 - 1 / (4 * 5 * 5))
    assert (
        "argmax agreement 99.00% < 100.00% (1 of 100 differ)" in result["message"]
        and not result["passed"]
    )


def test_parity_holds_every_output_and_names_the_one_that_moved():
    ref = {"cultivar_logits": np.ones((3, 3), np.float32), "alcohol": np.full(3, 13.0, np.float32)}
    same = gates.compare({k: v.copy() for k, v in ref.items()}, ref, atol=1e-4, rtol=1e-3)
    assert same["passed"] and set(same["outputs"]) == {"cultivar_logits", "alcohol"}
    moved = {**ref, "alcohol": ref["alcohol"] + 0.5}
    result = gates.compare(moved, ref, atol=1e-4, rtol=1e-3)
    assert not result["passed"] and result["output"] == "alcohol"
    assert result["message"].startswith(
        "|diff| of alcohol exceeds atol 0.0001 + rtol 0.001 x |alcohol| by"
    )
    table = {
        (row["gate"], row["figure"]): row["value"] for row in gates.table({"parity.b7": result})
    }
    assert table["parity.b7", "alcohol.max_abs"] == pytest.approx(0.5)
    assert table["parity.b7", "cultivar_logits.max_abs"] == 0


def test_targets_of_a_dict_come_back_from_every_rank_in_the_split_order():
    """What gather_in_order does with the shards all_gather_object returns: rank r held samples r,
    r+W, ..."""
    shards = [
        {"cultivar": torch.tensor([0, 2, 4]), "alcohol": torch.tensor([0.0, 2.0, 4.0])},
        {"cultivar": torch.tensor([1, 3]), "alcohol": torch.tensor([1.0, 3.0])},
    ]
    joined = _interleave(shards, shards[0], 2)
    assert joined["cultivar"].tolist() == [0, 1, 2, 3, 4] and joined["alcohol"].tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]
    pairs = [
        (torch.tensor([0, 2]), torch.tensor([[0.0], [2.0]])),
        (torch.tensor([1]), torch.tensor([[1.0]])),
    ]
    joined = _interleave(pairs, pairs[0], 2)
    assert joined[0].tolist() == [0, 1, 2] and joined[1][:, 0].tolist() == [0, 1, 2]


def test_a_custom_loss_and_metric_get_dicts_as_they_are():
    cfg = config_from_dict(
        {
            "task": {
                "name": "custom",
                "loss": {"component": "examples.wine.metrics:joint_loss"},
                "metric": {"component": "examples.wine.metrics:both"},
                "metric_mode": "max",
            }
        }
    ).task
    task = build_task(cfg, None)
    outputs = {
        "cultivar_logits": torch.tensor([[5.0, 0, 0], [0, 5.0, 0]]),
        "alcohol": torch.tensor([13.0, 12.0]),
    }
    target = {"cultivar": torch.tensor([0, 1]), "alcohol": torch.tensor([13.0, 14.0])}
    task.check_output(outputs, target, WHERE)
    task.check_metric(outputs, target, WHERE)
    assert task.primary == "cultivar_accuracy"
    state = task.new_state(torch.device("cpu"))
    task.update(state, task.named(outputs), target)
    task.reduce(state, DistInfo.cpu_alone())
    metrics = task.metrics(state)
    assert metrics["cultivar_accuracy"] == 1.0 and metrics["alcohol_rmse"] == pytest.approx(
        np.sqrt(2.0)
    )
    assert task.output_names == ["cultivar_logits", "alcohol"]


def test_num_classes_reaches_a_factory_that_takes_kwargs():
    """timm.create_model(model_name, pretrained=False, **kwargs) names no num_classes: it goes
    through **kwargs."""
    from pipeline.components.build import build_data, model_spec

    cfg = config_from_dict(
        {
            "model": {
                "component": "examples.image_zoo:create_model",
                "args": {"model_name": "tinynet", "in_chans": 1},
            }
        }
    )
    splits = build_data(cfg.data, cfg.task.name)
    spec, from_data = model_spec(cfg.model, splits, build_task(cfg.task, splits.classes))
    assert from_data == {"num_classes": 10} and spec.args["num_classes"] == 10
    # the data's other hints go only to parameters the factory names
    assert "in_channels" not in spec.args


def test_each_task_checks_its_own_data():
    with pytest.raises(
        DataError, match="the training set has classes \\(a\\) but task.name=regression"
    ):
        Regression.check_data(["a"], "data")
    with pytest.raises(DataError, match="classification needs an int64 class index"):
        Classification.check_target(torch.tensor(0.5), None, "item 0")


def test_a_loss_reading_fields_as_attributes_works_in_training_and_in_evaluation(
    tmp_path, monkeypatch
):
    """A transformers-style loss (`outputs.logits`) gets the ModelOutput in training and, in
    evaluation and the export gates, the outputs rebuilt by name: both read the same way."""
    import sys
    import types

    module = types.ModuleType("attr_loss_project")
    module.loss = lambda outputs, target: torch.nn.functional.cross_entropy(outputs.logits, target)
    module.metric = lambda outputs, target: float(
        (outputs.logits.argmax(1) == target).float().mean()
    )
    monkeypatch.setitem(sys.modules, "attr_loss_project", module)
    monkeypatch.setenv("TRAINSERVE_TRUSTED_COMPONENTS", "attr_loss_project.*")
    cfg = config_from_dict(
        {
            "task": {
                "name": "custom",
                "loss": {"component": "attr_loss_project:loss"},
                "metric": {"component": "attr_loss_project:metric"},
                "metric_mode": "max",
            }
        }
    ).task
    task = build_task(cfg, None)
    output, target = (
        Classified(torch.tensor([[3.0, 0.0], [0.0, 3.0]]), torch.zeros(2, 4)),
        torch.tensor([0, 1]),
    )
    task.check_output(output, target, WHERE)
    task.check_metric(output, target, WHERE)
    state = task.new_state(torch.device("cpu"))
    task.update(state, task.named(output), target)
    task.reduce(state, DistInfo.cpu_alone())
    assert task.metrics(state)["metric"] == 1.0
