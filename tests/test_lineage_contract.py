"""The lineage contract (serving/lineage.py) is the one place a `trainserve.*` key is spelled: the
exporter writes through it and the loader, verify, trace and promote read through it. A new key
written elsewhere would be a second contract nobody checks; this test finds it."""

from __future__ import annotations

import re
from pathlib import Path

from serving import lineage
from serving.lineage import Lineage

REPO = Path(__file__).resolve().parents[1]
# trainserve.json is a file name, not a key
KEY = re.compile(r"""trainserve\.(?!json\b)[a-z_]""")
LOGGER = re.compile(r"""getLogger\(["']trainserve\.""")


def test_no_lineage_key_is_spelled_outside_the_contract():
    found = []
    for path in sorted(
        [
            *REPO.glob("pipeline/**/*.py"),
            *REPO.glob("serving/**/*.py"),
            *REPO.glob("serving/**/*.cc"),
        ]
    ):
        if path == REPO / "serving" / "lineage.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if KEY.search(LOGGER.sub("", line)):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_run_has_at_most_twelve_tags_a_person_reads():
    assert len(lineage.RUN_TAGS) == len(set(lineage.RUN_TAGS)) <= 12


def test_the_file_and_the_version_say_the_same_lineage():
    said = Lineage(
        run_id="r1",
        checkpoint="step_00000088",
        step="88",
        model="pipeline.models:resnet18",
        data="pipeline.datasets:digits",
        task="classification",
        config_sha256="c" * 64,
        weights_sha256="w" * 64,
        weights_meta_sha256="m" * 64,
        data_sha256={"train": "t" * 64, "val": "v" * 64},
    )
    assert Lineage.read(said.metadata()) == said
    import json

    tags = said.version_tags() | {
        lineage.SHA256: json.dumps({"model.onnx": "o" * 64, **said.digests()})
    }
    from_version = Lineage.read(tags)
    # model.json's: the file's only
    assert from_version == Lineage(**{**said.as_dict(), "weights_meta_sha256": ""})
    assert lineage.recorded_sha256(tags, "model.onnx") == "o" * 64 and lineage.recorded_files(
        tags
    ) == {"model.onnx": "o" * 64}
    # no path on a version
    assert not [v for v in said.version_tags().values() if "/" in v]


def test_stages_read_back_in_order():
    text = lineage.write_stages({"export": "running", "train": "done", "consolidate": "done"})
    assert text == "done: train, consolidate · running: export"
    assert lineage.read_stages(text) == {
        "train": "done",
        "consolidate": "done",
        "export": "running",
    }
    assert lineage.read_stages(None) == {}


def test_versions_and_files_of_before_the_contract_read_the_same():
    """What the export recorded before `trainserve.sha256`, and the ONNX metadata keys it wrote,
    still read."""
    old_tags = {
        "trainserve.onnx_sha256": "a",
        "trainserve.onnx_fp16_sha256": "b",
        "trainserve.onnx_data_sha256": "c",
        "trainserve.onnx_int8_data_sha256": "d",
        "trainserve.drift_sha256": "e",
        "trainserve.weights_sha256": "w",
        "trainserve.data.val_sha256": "v",
        "trainserve.run_id": "r",
    }
    assert lineage.sha256_record(old_tags) == {
        "model.onnx": "a",
        "model.fp16.onnx": "b",
        "model.onnx.data": "c",
        "model.int8.onnx.data": "d",
        "drift_reference.json": "e",
        "weights": "w",
        "val": "v",
    }
    assert lineage.recorded_files(old_tags) == {"model.onnx": "a", "model.fp16.onnx": "b"}
    # registered by hand: records nothing
    assert lineage.sha256_record({"trainserve.run_id": "r"}) is None
    old_file = {
        "trainserve.checkpoint_step": "88",
        "trainserve.model_component": "m",
        "trainserve.data_component": "d",
        "trainserve.data.train_sha256": "t",
    }
    found = Lineage.read(old_file)
    assert (found.step, found.model, found.data, found.data_sha256) == (
        "88",
        "m",
        "d",
        {"train": "t"},
    )
