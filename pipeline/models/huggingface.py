"""A Hugging Face transformers model built from a config, with no weights downloaded and no wrapper:
`model.component: pipeline.models.huggingface:from_config` with `args: {architecture:
BertForSequenceClassification, hidden_size: 64, ...}`. Its output (a `SequenceClassifierOutput`)
goes through every stage as it is: the tasks find `logits` in it, export names each field.

`num_classes` (which trainserve fills from the training set's classes) becomes the config's
`num_labels`, and `vocab_size` (a data set's `model_args` may suggest it) the config's own; every
other argument is a field of the architecture's config class (`BertConfig` for Bert...). Needs
`pip install transformers`.
"""

from __future__ import annotations

from typing import Any


def from_config(
    architecture: str, num_classes: int | None = None, vocab_size: int | None = None, **config: Any
):
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "pipeline.models.huggingface needs the transformers package: pip install -c "
            ".venv/constraints.txt transformers"
        ) from None
    model_class = getattr(transformers, architecture, None)
    if model_class is None or not hasattr(model_class, "config_class"):
        raise ValueError(
            f"architecture={architecture!r} is not a transformers model class (e.g. "
            "BertForSequenceClassification, DistilBertForSequenceClassification)"
        )
    if num_classes is not None:
        config["num_labels"] = num_classes
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    model = model_class(model_class.config_class(**config))
    return model
