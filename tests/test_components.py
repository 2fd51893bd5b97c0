"""The component contract: a user's model, data and task named in the config, imported the ordinary
way, and every kind of bad component stopped before anything starts with one clear message.

The user's project is a real module the test writes into a directory on sys.path; `preflight` is
what `pipeline train/run --nproc-per-node` call before spawning torchrun.
"""

from __future__ import annotations

import sys
import textwrap
import time

import pytest
import torch
from conftest import run_cli

from pipeline.components.build import ModelSpec, instantiate_model, preflight
from pipeline.components.data import DataError
from pipeline.components.reference import (
    ArtifactSource,
    ComponentError,
    check_all_trusted,
    check_trusted,
)
from pipeline.config import ConfigError, load_config
from pipeline.distributed.parallelize import fsdp_units, repeated_block
from pipeline.tools.logs import first_line

PROJECT = '''
import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

NOT_CALLABLE = 3


class Pairs(Dataset):
    """Items built by `make(i)`; `classes` and `model_args` when given."""
    def __init__(self, n, make, classes=None, model_args=None):
        self.n, self.make = n, make
        if classes is not None:
            self.classes = classes
        if model_args is not None:
            self.model_args = model_args
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return self.make(i)


def table(i):
    return {"features": torch.full((4,), float(i)), "code": torch.tensor(i % 3)}, torch.tensor(i % 2)


def tabular(n=40, target="class", classes=("no", "yes"), valid_key="val", inputs="dict"):
    def make(i):
        x = table(i)[0] if inputs == "dict" else torch.full((4,), float(i))
        y = {"class": torch.tensor(i % 2), "float": torch.tensor(float(i)), "int": torch.tensor(i % 2, dtype=torch.int32),
             "vector": torch.rand(3)}[target]
        return x, y
    hints = {"in_features": 4}
    return {"train": Pairs(n, make, list(classes) if classes else None, hints), valid_key: Pairs(8, make)}


class Net(nn.Module):
    def __init__(self, in_features, num_classes=2, hidden=8):
        super().__init__()
        self.embed = nn.Embedding(3, 2)
        self.body = nn.Sequential(nn.Linear(in_features + 2, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
    def forward(self, features, code):
        return self.body(torch.cat([features, self.embed(code)], 1))


class PositionalNet(nn.Module):
    """Takes the dict as one argument: not the contract (dict inputs are keyword arguments)."""
    def __init__(self, in_features, num_classes=2):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)
    def forward(self, batch):
        return self.fc(batch["features"])


class Flat(nn.Module):
    def __init__(self, in_features, out=1):
        super().__init__()
        self.fc = nn.Linear(in_features, out)
    def forward(self, x):
        return self.fc(x)


def returns_dict(in_features):
    return {"not": "a module"}


def raises(in_features):
    raise ValueError("hidden must be positive")


def not_a_dict():
    return [1, 2]


def iterable():
    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(2), torch.tensor(0)
    return {"train": Stream(), "val": Stream()}


def triples():
    return {"train": Pairs(4, lambda i: (torch.zeros(2), torch.tensor(0), "extra")), "val": Pairs(4, lambda i: (1, 2))}


def numpy_inputs():
    return {"train": Pairs(4, lambda i: (np.zeros(2, np.float32), torch.tensor(0))), "val": Pairs(4, lambda i: (1, 2))}


class NeedsClasses(nn.Module):
    def __init__(self, in_features, num_classes):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)


def float64_features():
    return {"train": Pairs(8, lambda i: (torch.rand(4, dtype=torch.float64), torch.tensor(i % 2))),
            "val": Pairs(8, lambda i: (torch.rand(4, dtype=torch.float64), torch.tensor(i % 2)))}


def verdict(outputs, targets):
    return "good"


def strict_auc(outputs, targets):
    raise ValueError("Only one class present in y_true")


def bf16_inputs():
    return {"train": Pairs(4, lambda i: (torch.zeros(2, dtype=torch.bfloat16), torch.tensor(0))),
            "val": Pairs(4, lambda i: (torch.zeros(2, dtype=torch.bfloat16), torch.tensor(0)))}


def with_tensor_hint():
    splits = tabular(inputs="tensor")
    splits["train"].model_args = {"in_features": 4, "scale": object()}
    return splits


class Scaled(nn.Module):
    def __init__(self, in_features, scale=1.0, num_classes=2):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)
    def forward(self, x):
        return self.fc(x)
'''

BROKEN_IMPORT = "import a_dependency_nobody_installed\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project directory on sys.path holding `userproj.py`, never seen by trainserve."""
    (tmp_path / "userproj.py").write_text(textwrap.dedent(PROJECT))
    (tmp_path / "broken.py").write_text(BROKEN_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("userproj", "broken"):
        sys.modules.pop(name, None)


def check(*overrides):
    """`preflight` of the user project's config with these overrides, as the launcher runs it."""
    base = ["data.component=userproj:tabular", "model.component=userproj:Net"]
    cfg = load_config(None, [*base, *overrides])
    return preflight(cfg.data, cfg.task, cfg.model, cfg.train, cfg.export)


def refused(*overrides) -> str:
    with pytest.raises((ConfigError, DataError)) as err:
        check(*overrides)
    return str(err.value)


def test_a_users_model_data_and_task_pass_and_the_data_fills_in_what_the_model_needs(project):
    built = check()
    assert built.model_spec == ModelSpec("userproj:Net", {"in_features": 4, "num_classes": 2})
    assert built.suggested == {"in_features": 4, "num_classes": 2}
    assert [(s.name, s.dtype, s.shape) for s in built.splits.inputs] == [
        ("features", torch.float32, (4,)),
        ("code", torch.int64, ()),
    ]
    assert built.task.num_classes == 2 and built.task.labels == ["no", "yes"]
    # model.args wins over what the data suggests
    assert check("model.args.num_classes=2", "model.args.hidden=4").model_spec.args["hidden"] == 4


CUSTOM = [
    "task.name=custom",
    "task.loss.component=torch.nn:L1Loss",
    "task.metric_mode=min",
    "data.args.target=vector",
    "data.args.classes=null",
    "data.args.inputs=tensor",
    "model.component=userproj:Flat",
    "model.args.out=3",
]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["model.component=nowhere.models:Net"],
            "model.component 'nowhere.models:Net': cannot import module 'nowhere.models' (ModuleNotFoundError: No module "
            "named 'nowhere'). Install your package",
        ),
        (
            ["model.component=broken:Net"],
            "model.component 'broken:Net': importing 'broken' failed inside it (ModuleNotFoundError: No module named "
            "'a_dependency_nobody_installed')",
        ),
        (["model.component=userproj:net"], "'userproj' has no attribute 'net'; did you mean 'Net'"),
        (
            ["model.component=userproj:NOT_CALLABLE"],
            "model.component 'userproj:NOT_CALLABLE' is a int, not callable",
        ),
        (
            ["model.args.hiden=4"],
            "model.args do not fit userproj:Net(in_features, num_classes=2, hidden=8): got an "
            "unexpected keyword argument 'hiden'",
        ),
        (
            [
                "data.args.classes=null",
                "model.args.in_features=4",
                "model.component=userproj:NeedsClasses",
            ],
            "missing a required argument: 'num_classes' (given: in_features); set model.args to what it takes (or let the "
            "training set suggest them: num_classes follows from its `classes`",
        ),
        (
            [
                "data.component=userproj:float64_features",
                "model.component=userproj:Flat",
                "model.args={in_features: 4, out: 2}",
            ],
            "input(s) input are float64 and the model's parameters float32: give float32 tensors",
        ),
        (
            ["model.component=userproj:returns_dict"],
            "model.component 'userproj:returns_dict' returned a dict; it must return a torch.nn.Module",
        ),
        (
            ["model.component=userproj:raises"],
            "model.component 'userproj:raises' raised ValueError: hidden must be positive",
        ),
        (
            ["data.component=userproj:not_a_dict"],
            'data.component \'userproj:not_a_dict\' returned a list; it must return a dict {"train": Dataset, "val": Dataset}',
        ),
        (
            ["data.args.valid_key=valid"],
            "it must return exactly 'train' and 'val'; unexpected: 'valid' (did you mean 'val'?)",
        ),
        (
            ["data.component=userproj:iterable"],
            "is an IterableDataset without state_dict()/load_state_dict(): a resume could only",
        ),
        (
            ["data.component=userproj:triples"],
            "split 'train' item 0 is a tuple of 3; items must be (inputs, target) pairs",
        ),
        (
            ["data.component=userproj:numpy_inputs"],
            "inputs are a ndarray; they must be a tensor or a non-empty dict",
        ),
        (
            ["data.component=userproj:bf16_inputs"],
            "input 'input' is bfloat16, which a served model can't take",
        ),
        (
            CUSTOM + ["task.metric.component=userproj:verdict"],
            "on 8 validation samples: task.metric must return a number or a dict of numbers, got 'good'",
        ),
        (
            CUSTOM + ["task.metric.component=userproj:strict_auc"],
            "on 8 validation samples: task.metric raised ValueError: Only one class present in y_true",
        ),
        (
            ["data.args.target=float"],
            "the target is a float32 tensor of shape []; classification needs an int64 class "
            "index (a 0-d torch.long tensor or an int); for regression targets set task.name=regression",
        ),
        (
            ["data.args.target=int"],
            "the target is a int32 tensor of shape []; classification needs an int64 class index",
        ),
        (
            ["task.name=regression", "data.args.target=float"],
            "the training set has classes (no, yes) but task.name=regression; set task.name=classification, or drop",
        ),
        (
            ["task.name=regression", "data.args.target=class", "data.args.classes=null"],
            "the target is a int64 tensor of shape []; regression needs a float tensor (0-d for one value, 1-d for several); "
            "for class indices set task.name=classification",
        ),
        (
            ["data.args.classes=[a, b, c]", "model.args.num_classes=2"],
            "the model returns 2 logits per sample but the data has 3 classes (the training set's `classes`); set "
            "model.args.num_classes=3",
        ),
        (
            ["model.component=userproj:PositionalNet"],
            "TypeError: PositionalNet.forward() got an unexpected keyword argument 'features'; dict inputs are passed as "
            "keyword arguments, model(**inputs): forward() must take features, code",
        ),
        (
            [
                "task.name=regression",
                "data.args.target=vector",
                "data.args.classes=null",
                "data.args.inputs=tensor",
                "model.component=userproj:Flat",
            ],
            "the model returns a float32 tensor of shape [2, 1] for targets of shape [2, 3]; for regression it must return "
            "the target's shape",
        ),
        (
            ["data.component=userproj:with_tensor_hint", "model.component=userproj:Scaled"],
            "model.args.scale is a object; model arguments must be plain values",
        ),
    ],
)
def test_every_bad_component_gets_one_clear_error(project, overrides, expected):
    message = refused(*overrides)
    assert expected in message, message


def test_a_regression_task_on_a_users_model_passes(project):
    built = check(
        "task.name=regression",
        "data.args.target=float",
        "data.args.classes=null",
        "data.args.inputs=tensor",
        "model.component=userproj:Flat",
    )
    assert built.task.columns == 1 and built.model_spec.args == {"in_features": 4}


def test_a_component_named_by_an_artifact_is_not_imported_unless_trusted(project, monkeypatch):
    """A model.json or checkpoint from a shared store could name any callable: `os:system` with a
    command. It is refused before anything is imported; a user's module is imported once trusted."""
    source = ArtifactSource("/store/run/consolidated/model.json")
    marker = project / "imported"
    (project / "sideeffect.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef Net(): pass\n")
    for reference in ("os:system", "sideeffect:Net", "subprocess:run"):
        with pytest.raises(ComponentError, match="which is not trusted here"):
            check_trusted("model", reference, source)
    with pytest.raises(ComponentError) as err:
        instantiate_model(ModelSpec("sideeffect:Net", {}), source)
    # The suggestion trusts that one reference, not a whole package (`torch.*` would trust
    # torch:load).
    assert (
        "TRAINSERVE_TRUSTED_COMPONENTS='sideeffect:Net'" in str(err.value) and not marker.exists()
    )
    # built in
    check_trusted("model", "pipeline.models:resnet18", source)
    # --trust / pipeline run's config
    check_trusted("model", "userproj:Net", ArtifactSource("x", ("userproj:*",)))
    monkeypatch.setenv("TRAINSERVE_TRUSTED_COMPONENTS", "other.*, userproj:*")
    check_trusted("model", "userproj:Net", source)
    with pytest.raises(ComponentError):
        check_trusted("model", "os:system", source)


@pytest.mark.parametrize(
    "reference, why",
    [
        (
            "pipeline.models:resnet.torch.os.system",
            "must be a public class or function of the module it names",
        ),
        (
            "pipeline.models:resnet",
            "which is a module, not a class or function of 'pipeline.models'",
        ),
        ("pipeline.models.resnet:nn", "which is a module"),
        # imported, not defined
        (
            "pipeline.models.resnet:Normalize",
            "which is defined in 'pipeline.models.layers'",
        ),
        ("pipeline.models:_private", "must be a public class or function"),
        ("pipeline.models:*", "is not a reference of the form"),
        ("pipeline.modelsx:resnet18", "which is not trusted here"),
    ],
)
def test_trusting_a_module_trusts_its_own_classes_and_functions_not_what_it_reaches(reference, why):
    """A trusted pattern matches the module alone, and the reference must name what that module
    itself defines: through `pipeline.models:resnet.torch.os.system` a model.json reached os.system
    before."""
    with pytest.raises(ComponentError, match=why.replace("(", "\\(")):
        instantiate_model(
            ModelSpec(reference, {"command": "echo owned > /tmp/owned"}),
            ArtifactSource("model.json"),
        )


def test_fsdp_units_follow_train_fsdp_wrap_or_the_repeated_block(project):
    from pipeline.models import resnet18

    model = resnet18(num_classes=10, in_channels=1, width=0.125)
    assert repeated_block(model) == "BasicBlock"
    assert [type(m).__name__ for m in fsdp_units(model, [])] == ["BasicBlock"] * 8
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    encoder = torch.nn.Sequential(
        torch.nn.Embedding(5, 8), torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    )
    assert repeated_block(encoder) == "TransformerEncoderLayer"
    units = fsdp_units(encoder, ["TransformerEncoderLayer", "Embedding"])
    assert (
        sorted(type(u).__name__ for u in units) == ["Embedding"] + ["TransformerEncoderLayer"] * 3
    )
    with pytest.raises(
        ConfigError,
        match=r"train.fsdp_wrap names \['TransformerLayer'\], but the model has no module "
        "of that class; its module classes are: .*TransformerEncoderLayer",
    ):
        fsdp_units(encoder, ["TransformerLayer"])


@pytest.mark.slow
def test_a_bad_component_stops_the_launcher_before_torchrun_starts(tmp_path):
    """`pipeline train --nproc-per-node 2` with a typo in the model's args: one error, exit 2, no
    rank started."""
    (tmp_path / "userproj.py").write_text(textwrap.dedent(PROJECT))
    (tmp_path / "mine.yaml").write_text(
        "data: {component: userproj:tabular}\nmodel: {component: userproj:Net, args: {hiden: 4}}\n"
    )
    start = time.monotonic()
    proc = run_cli(
        ["train", "--config", "mine.yaml", "--nproc-per-node", "2"], cwd=tmp_path, check=False
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert lines == [
        "pipeline train: error: model.args do not fit userproj:Net(in_features, num_classes=2, hidden=8): "
        "got an unexpected keyword argument 'hiden'; did you mean 'hidden'? (given: hiden, in_features, "
        "num_classes); set "
        "model.args to what it takes"
    ], proc.stderr
    assert "[rank" not in proc.stderr and not (tmp_path / "outputs").exists()
    assert time.monotonic() - start < 60


def test_trust_splits_on_commas_like_the_environment_variable(monkeypatch):
    """`--trust 'a.*,b.*'` is two patterns, as TRAINSERVE_TRUSTED_COMPONENTS='a.*,b.*' is."""
    monkeypatch.delenv("TRAINSERVE_TRUSTED_COMPONENTS", raising=False)
    source = ArtifactSource("model.json", ("my_project.*, timm.*",))
    check_trusted("model", "my_project.models:Net", source)
    check_trusted("model", "timm:create_model", source)
    with pytest.raises(ComponentError):
        check_trusted("model", "os:system", source)


def test_every_untrusted_component_is_named_in_one_refusal_with_one_trust_to_copy(monkeypatch):
    monkeypatch.delenv("TRAINSERVE_TRUSTED_COMPONENTS", raising=False)
    source = ArtifactSource("/store/run/consolidated/model.json")
    references = {
        "model": "my_project.models:Net",
        "data": "my_project.data:load",
        "task.loss": "pipeline.models:mlp",
        "task.metric": "my_project.metrics:score",
    }
    with pytest.raises(ComponentError) as err:
        check_all_trusted(references, source)
    message = str(err.value)
    them = "my_project.models:Net,my_project.data:load,my_project.metrics:score"
    assert (
        "model.component 'my_project.models:Net', data.component 'my_project.data:load', task.metric.component "
        "'my_project.metrics:score', which are not trusted here" in message
    )
    assert message.endswith(f"--trust '{them}' (or TRAINSERVE_TRUSTED_COMPONENTS='{them}')")
    # What verify and every stage print of it: the whole refusal, the fix at its end included.
    assert first_line(err.value) == message and len(message) > 300
    # the fix, pasted as it is, is enough
    check_all_trusted(references, ArtifactSource("model.json", (them,)))
