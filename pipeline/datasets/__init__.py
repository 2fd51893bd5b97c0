"""Built-in data sets: components like any user's (`data.component: pipeline.datasets:digits`).

    images.py         ImageTensors: images and labels held in memory, batched in one index operation
    digits.py         scikit-learn's 8x8 handwritten digits (ships offline)
    fashion_mnist.py  Fashion-MNIST from its four IDX files in a local directory (nothing
                      downloaded)
    synthetic.py      random images of a chosen shape, for benchmarks
    digit_tokens.py   the digits as token sequences with a tag per token (token classification)
    image_folder.py   a folder of image files, one sub-folder a class (Pillow), read lazily
    sharded.py        splits written as Parquet shards (`pipeline data shard`), the training split
                      streamed

The image sets return {"train": ImageTensors, "val": ImageTensors}; the training set carries
`classes` and `model_args` (in_channels, image_size, and its per-channel mean/std) for the built-in
models.
"""

from pipeline.datasets.digit_tokens import digit_tokens  # noqa: F401
from pipeline.datasets.digits import digits  # noqa: F401
from pipeline.datasets.fashion_mnist import fashion_mnist  # noqa: F401
from pipeline.datasets.image_folder import image_folder  # noqa: F401
from pipeline.datasets.sharded import sharded  # noqa: F401
from pipeline.datasets.synthetic import synthetic  # noqa: F401
