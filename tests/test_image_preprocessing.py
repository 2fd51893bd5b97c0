"""An image model's preprocessing travels with the data and the model: `image_folder` carries it,
`pipeline data shard` keeps it in both manifests (and a few validation files beside the shards), the
sharded splits give it back, and export's `preprocessing` gate proves that the transform a file
records, applied by the server to the validation split's own files, gives the tensors training fed
the model. Real image files, real shards, small ONNX files with the metadata export writes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import REPO
from PIL import Image
from serving_fixtures import tiny_model

from pipeline.artifact import gates
from pipeline.errors import DataError
from pipeline.shards import format as shard_format
from serving import lineage
from serving.images import Preprocessing, record

GREY = Preprocessing(mode="L", size=(8, 8))


def photos(root, count: int = 40):
    """Grey 8x8 PNG digits from scikit-learn, a folder a class (three classes)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    kept = [(x, y) for x, y in zip(digits.images, digits.target) if y < 3][:count]
    for i, (image, label) in enumerate(kept):
        folder = root / ["zero", "one", "two"][label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 16).astype(np.uint8)).save(folder / f"{i:04d}.png")
    return root


def recording(path, preprocessing: Preprocessing | None):
    """tiny_model (input [batch, 1, 8, 8]) with `preprocessing` in its metadata, as export records
    it."""
    tiny_model(path)
    if preprocessing is not None:
        model = onnx.load(str(path))
        model.metadata_props.add(key=lineage.PREPROCESSING, value=record("input", preprocessing))
        onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return photos(tmp_path_factory.mktemp("photos") / "photos")


def test_the_gate_passes_on_the_transform_training_applied(tmp_path, folder):
    from pipeline.datasets.image_folder import image_folder

    val = image_folder(str(folder), image_size=8)["val"]
    found = gates.preprocessing(recording(tmp_path / "m.onnx", GREY), val)["preprocessing"]
    assert found["passed"], found
    assert found["images"] == len(val) and found["max_abs"] == 0.0


@pytest.mark.parametrize(
    "served, why",
    [
        (
            Preprocessing(mode="L", size=(8, 8), divide_by=1.0),
            '"divide_by": 1.0, "layout": "CHW"}, which is not how training made its inputs',
        ),
        (
            Preprocessing(mode="L", size=(8, 8), mean=(0.5,), std=(0.25,)),
            "which is not how training made its inputs",
        ),
        (
            Preprocessing(mode="L", size=(8, 8), resample="nearest"),
            "the server's tensors differ from training's",
        ),
        (
            Preprocessing(mode="RGB", size=(8, 8)),
            "the server makes [3, 8, 8], training fed [1, 8, 8]",
        ),
    ],
    ids=["divisor", "normalization", "resampling", "channels"],
)
def test_the_gate_fails_when_the_served_transform_differs(tmp_path, folder, served, why):
    from pipeline.datasets.image_folder import image_folder

    # resized from 8x8 to 6x6, so that nearest and bilinear resampling give other pixels
    val = image_folder(str(folder), image_size=6)["val"]
    made = dict(served.to_json(), size=[6, 6])
    found = gates.preprocessing(recording(tmp_path / "m.onnx", Preprocessing.from_json(made)), val)
    assert not found["preprocessing"]["passed"]
    assert why.replace("8, 8]", "6, 6]") in found["preprocessing"]["message"], found


def test_no_gate_for_a_file_that_records_no_preprocessing(tmp_path, folder):
    from pipeline.datasets.image_folder import image_folder

    val = image_folder(str(folder), image_size=8)["val"]
    assert gates.preprocessing(recording(tmp_path / "m.onnx", None), val) == {}


def test_the_gate_fails_where_the_data_gives_no_files_to_prove_it_on(tmp_path):
    from pipeline.datasets.digits import digits

    found = gates.preprocessing(recording(tmp_path / "m.onnx", GREY), digits()["val"])
    assert not found["preprocessing"]["passed"]
    assert "gives no image files" in found["preprocessing"]["message"]


def shard(folder, out, *extra: str):
    from pipeline import data_cli

    return data_cli.main(
        str(REPO / "configs/digits_resnet18.yaml"),
        [
            "data.component=pipeline.datasets:image_folder",
            f"data.args={{root: {folder}, image_size: 8}}",
            *extra,
        ],
        str(out),
    )


def test_shards_of_an_image_folder_carry_its_transform_and_files_to_prove_it_on(tmp_path, folder):
    from pipeline.shards.stream import ShardedStream, ShardRows

    written = shard(folder, tmp_path / "shards")
    for split in ("train", "val"):
        body = json.loads((tmp_path / "shards" / split / "manifest.json").read_text())
        assert body["preprocessing"]["transform"] == GREY.to_json()
        assert body["digest"] == written[split].digest
    assert written["train"].preprocessing["examples"] == []
    kept = written["val"].preprocessing["examples"]
    # a small split: every file (at most 64)
    assert len(kept) == written["val"].rows
    train, val = (
        ShardedStream(str(tmp_path / "shards/train")),
        ShardRows(str(tmp_path / "shards/val")),
    )
    assert train.preprocessing == val.preprocessing == GREY
    # the gate on the shards: the files kept beside them, against the rows training reads
    found = gates.preprocessing(recording(tmp_path / "m.onnx", GREY), val)["preprocessing"]
    assert found["passed"] and found["images"] == len(kept), found
    wrong = recording(tmp_path / "wrong.onnx", Preprocessing(mode="L", size=(8, 8), divide_by=16.0))
    assert not gates.preprocessing(wrong, val)["preprocessing"]["passed"]


def test_the_transform_and_its_files_are_in_the_split_identity(tmp_path, folder):
    written = shard(folder, tmp_path / "shards")["val"]
    body = written.body()
    assert shard_format.manifest_digest(body) == written.digest
    for changed in (
        {**body["preprocessing"], "transform": {**GREY.to_json(), "divide_by": 1.0}},
        {**body["preprocessing"], "examples": body["preprocessing"]["examples"][1:]},
    ):
        assert shard_format.manifest_digest({**body, "preprocessing": changed}) != written.digest
    # a split of data without images: the digest it had before preprocessing joined the manifest
    plain = {k: v for k, v in body.items() if k != "preprocessing"}
    assert shard_format.manifest_digest(plain) == shard_format.manifest_digest(
        {**plain, "preprocessing": {}}
    )


def test_a_changed_or_missing_example_file_is_named(tmp_path, folder):
    written = shard(folder, tmp_path / "shards")["val"]
    first = tmp_path / "shards/val" / written.preprocessing["examples"][0]["file"]
    first.write_bytes(first.read_bytes() + b"x")
    with pytest.raises(DataError, match=f"{first.name} is not the file the manifest names"):
        shard_format.read_examples(shard_format.read_manifest(str(tmp_path / "shards/val")))
    first.unlink()
    with pytest.raises(DataError, match=f"{first.name} is missing"):
        shard_format.read_examples(shard_format.read_manifest(str(tmp_path / "shards/val")))


def test_a_manifest_whose_transform_does_not_make_its_input_is_damaged(tmp_path, folder):
    shard(folder, tmp_path / "shards")
    path = tmp_path / "shards/val/manifest.json"
    body = json.loads(path.read_text())
    body["preprocessing"]["transform"]["mode"] = "RGB"
    path.write_text(json.dumps(body))
    with pytest.raises(DataError, match=r"its preprocessing makes float32 \[3, 8, 8\], its input"):
        shard_format.read_manifest(str(tmp_path / "shards/val"))


def test_a_preprocessing_that_does_not_make_the_input_is_refused_by_the_data_check(folder):
    from pipeline.components.data import check_splits
    from pipeline.config import TaskConfig
    from pipeline.datasets.image_folder import image_folder
    from pipeline.tasks import build_task

    splits = image_folder(str(folder), image_size=8)
    task = build_task(TaskConfig(), ["zero", "one", "two"])
    assert check_splits(splits, "image_folder", task).preprocessing == GREY
    splits["train"].preprocessing = Preprocessing(mode="L", size=(16, 16))
    with pytest.raises(
        DataError, match=r"makes float32 \[1, 16, 16\] from an image, but a sample's"
    ):
        check_splits(splits, "image_folder", task)
    splits["train"].preprocessing = {"mode": "L"}
    with pytest.raises(DataError, match="must be a serving.images.Preprocessing, got dict"):
        check_splits(splits, "image_folder", task)


def test_digits_carry_no_preprocessing_and_their_shards_none(tmp_path):
    from pipeline import data_cli

    written = data_cli.main(str(REPO / "configs/digits_resnet18.yaml"), [], str(tmp_path / "d"))
    assert written["train"].preprocessing == written["val"].preprocessing == {}
    assert "preprocessing" not in json.loads((tmp_path / "d/val/manifest.json").read_text())


def test_export_records_the_transform_and_the_scores_of_an_image_classifier_and_none_for_tiff(
    tmp_path,
):
    """What export writes into the ONNX metadata from the data: the transform and the output an
    answer ranks; a folder of TIFF files, which a server does not decode, gets none (its model takes
    tensors only)."""
    from pipeline.components.data import check_splits
    from pipeline.config import TaskConfig
    from pipeline.datasets.image_folder import image_folder
    from pipeline.export import image_metadata
    from pipeline.tasks import build_task

    task = build_task(TaskConfig(), ["zero", "one", "two"])
    outputs = ["logits", "probabilities"]
    folder = photos(tmp_path / "png", 12)
    found = image_metadata(check_splits(image_folder(str(folder), 8), "f", task), task, outputs)
    assert json.loads(found[lineage.PREPROCESSING]) == {"input": GREY.to_json()}
    assert found[lineage.SCORES] == "probabilities"
    for path in list(folder.rglob("*.png")):
        Image.open(path).save(path.with_suffix(".tif"))
        path.unlink()
    splits = check_splits(image_folder(str(folder), 8), "f", task)
    assert image_metadata(splits, task, outputs) == {}
    gate = gates.preprocessing(recording(tmp_path / "m.onnx", GREY), splits.val)["preprocessing"]
    assert not gate["passed"] and "is of a format a server decodes" in gate["message"], gate
