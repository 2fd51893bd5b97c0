"""Built-in models: components like any user's (`model.component: pipeline.models:resnet18`).

    resnet.py   small-image ResNet-18 (the demo's model)
    mlp.py      a multilayer perceptron over flattened images
    layers.py   Normalize: input statistics as buffers, so the exported graph carries its
                preprocessing

Both take raw intensities in [0, 1]; the built-in image data sets suggest `in_channels`,
`image_size`, `mean` and `std` for them through their `model_args` attribute, and `num_classes`
follows from `classes`.
"""

from pipeline.models.mlp import mlp  # noqa: F401
from pipeline.models.resnet import resnet18  # noqa: F401
