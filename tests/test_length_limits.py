"""Export's view of sequence lengths, on the real token example (examples/digit_sequences): the
longest input it records for the server, and its warning for a token input exported at one fixed
length."""

from __future__ import annotations

import logging

import onnx
import pytest
import torch

from pipeline.artifact import gates, length_limits
from pipeline.artifact.onnx_export import ExportHead
from pipeline.tasks.classification import Classification
from serving import lengths

examples = pytest.importorskip("examples.digit_sequences.data")
from examples.digit_sequences.model import SequenceClassifier  # noqa: E402

AXES = {"tokens": [1], "mask": [1]}


@pytest.fixture(scope="module")
def splits():
    return examples.digit_sequences()


def test_the_limit_is_the_models_position_table_not_the_data_length(splits):
    """The data is 64 tokens long; the model positions up to max_len. The parity gate's batches (the
    real ones export builds) are what the limit is taken from when the model has no position
    limit."""
    model = SequenceClassifier(
        vocab_size=18, num_classes=10, dim=16, heads=2, layers=1, max_len=100
    )
    head = ExportHead(
        model, Classification([str(i) for i in range(10)], top_k=5), ["tokens", "mask"], False
    )
    batches, failed = gates.parity_batches(splits["val"], AXES, head)
    assert not failed
    assert length_limits.limits(model, batches, AXES) == {"tokens": {1: 100}, "mask": {1: 100}}
    # no position limit: what parity proved (97 = 64 + 33)
    plain = torch.nn.Sequential(torch.nn.Embedding(17, 4))
    proved = max(b["tokens"].shape[1] for b in batches.values())
    assert length_limits.limits(plain, batches, AXES) == {
        "tokens": {1: proved},
        "mask": {1: proved},
    }
    # no dynamic axis: the graph's own shape says it
    assert length_limits.limits(model, batches, {}) == {}

    proto = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    assert length_limits.record(proto, model, batches, AXES)
    assert lengths.read({p.key: p.value for p in proto.metadata_props}) == {
        "tokens": {1: 100},
        "mask": {1: 100},
    }


def test_hugging_face_style_config_gives_the_position_limit():
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"max_position_embeddings": 512})()
    assert length_limits.position_limit(model) == 512


def test_export_warns_when_token_lengths_vary_but_no_axis_is_dynamic(splits, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.export"):
        assert length_limits.warn_fixed_lengths(splits["val"], {}) == ["tokens", "mask"]
    assert "'export.dynamic_axes={tokens: [1], mask: [1]}'" in caplog.text
    caplog.clear()
    assert length_limits.warn_fixed_lengths(splits["val"], AXES) == []
    assert not caplog.text
