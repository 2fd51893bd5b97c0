"""Encoded images in, for a model version whose export recorded how an image file becomes its input
(lineage.PREPROCESSING, read by serving/images.py): one stage of the server's one inference path,
and what the front ends need to offer it.

The request input. Such a version takes, in place of that input (`input` for the built-in models),
the BYTES input `image` (`encoded_image` where the model has an input named `image`) of shape [-1]:
one encoded file an element (serving/images.py FORMATS: PNG, JPEG, GIF, BMP, WebP), each one row of
the model's input. It is listed in the model's metadata after the model's own inputs, over HTTP and
gRPC, so a client that reads the metadata (tritonclient) finds it; a request gives one of the two
(TensorSpec.stands_for, codec.given_inputs). A file POSTed whole with its Content-Type
(CONTENT_TYPES) to /invocations or /v2/models/NAME/infer is that input's one element
(`file_request`).

The stage (`decoded`, which Server.answer runs on every request before anything else): each element
decoded with Pillow and turned by `images.apply` into exactly the tensor training computed from that
file, in a decoding thread for a big request as a big body is; the rows then go the way of every
other request's (the batcher copies them into batch rows beside other requests'). An element that is
not an image file, or a damaged one, is a 400 naming it and what is wrong.

The answer to a POSTed file is the class names with their scores, best first, at most TOP: over V2
the classification extension (serving/classification.py) on the scores output (lineage.SCORES, else
the decision output); over /invocations {"predictions": [[{"label": ..., "score": ...}, ...]]}, a
list per file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from serving.codec import BadRequest, V2Request, dumps, encode_mlflow, shape_fits
from serving.engine import TensorSpec
from serving.envelope import Refused
from serving.images import FORMATS, Preprocessing, applied, decode, recorded
from serving.lineage import DECISION, PREPROCESSING, SCORES

log = logging.getLogger("serving.image_inputs")

# The request input's name: the first of these the model does not have already.
NAMES = ("image", "encoded_image")
CONTENT_TYPES = {f"image/{f.lower()}": f for f in FORMATS}
# Classes in the answer to a POSTed file.
TOP = 5


@dataclass
class ImageInput:
    """What a loaded version takes as encoded images: the request input's name, the model input it
    is decoded into, how, and the output whose scores an answer ranks (None: the model has none to
    rank)."""

    name: str
    target: str
    preprocessing: Preprocessing
    scores: str | None
    # (the engine's inputs the request inputs were made from, those request inputs): see
    # request_inputs
    _made: tuple = field(default=((), ()), repr=False, compare=False)

    def request_inputs(self, inputs: list[TensorSpec]) -> list[TensorSpec]:
        """The model's `inputs`, then this one in the place of its target: made again only when the
        engine's inputs change (Engine.set_batching replaces them)."""
        if self._made[0] is not inputs:
            target = next(s for s in inputs if s.name == self.target)
            spec = TensorSpec(
                self.name,
                np.dtype(object),
                "BYTES",
                (target.shape[0],),
                batched=target.batched,
                stands_for=target.name,
            )
            self._made = (inputs, [*inputs, spec])
        return self._made[1]

    def describe(self) -> dict:
        """As the model's metadata gives it (parameters.image_input)."""
        return {
            "name": self.name,
            "in_place_of": self.target,
            "content_types": sorted(CONTENT_TYPES),
            "preprocessing": self.preprocessing.to_json(),
            **({"scores": self.scores} if self.scores else {}),
        }


def image_input(engine, where: str) -> ImageInput | None:
    """What `engine`'s model takes as images, from its file's metadata; None where it records no
    preprocessing. A record that does not fit the model (no such float input, another shape) is said
    once in the log (`where` names the version) and the version takes no images: a server must not
    compute tensors the model was not trained on."""
    metadata = engine.metadata
    try:
        found = recorded(metadata)
    except ValueError as exc:
        log.warning("%s: takes no images: %s", where, exc)
        return None
    if found is None:
        return None
    target, preprocessing = found
    spec = next((s for s in engine.inputs if s.name == target), None)
    wanted = (-1, *preprocessing.shape)
    problem = (
        f"it has no input '{target}'"
        if spec is None
        else f"input '{target}' is {spec.describe()}, not FP32"
        if spec.datatype != "FP32"
        else f"input '{target}' is {spec.describe()}; the images become {list(wanted)}"
        if not shape_fits(spec, wanted)
        else ""
    )
    if problem:
        log.warning(
            "%s: takes no images: its %s is for input '%s', but %s",
            where,
            PREPROCESSING,
            target,
            problem,
        )
        return None
    names = {s.name for s in engine.inputs}
    name = next(n for n in (*NAMES, f"{target}_image") if n not in names)
    # a row of one score per class ([batch, classes]): what an answer ranks
    ranked = {s.name for s in engine.outputs if s.ranked and len(s.shape) == 2}
    scores = next((o for o in (metadata.get(SCORES), metadata.get(DECISION)) if o in ranked), None)
    found = ImageInput(name, target, preprocessing, scores)
    log.info(
        "%s takes image files (%s) as input '%s' [-1] BYTES, or POSTed whole, in place of '%s': %s",
        where,
        ", ".join(FORMATS),
        name,
        target,
        preprocessing.to_json(),
    )
    return found


def request_inputs(model) -> list[TensorSpec]:
    """The inputs a request to the loaded version `model` may give: its engine's, and its image
    input if any."""
    images = model.images
    return model.engine.inputs if images is None else images.request_inputs(model.engine.inputs)


# ---- the stage
# ------------------------------------------------------------------------------------------------


@dataclass
class FileRequest(V2Request):
    """A file POSTed whole as the body (`content_type` its Content-Type): the image input's one
    element."""

    content_type: str = ""


async def decoded(server, slot, request):
    """`request` with its encoded images, if any, decoded into the model's input (see the module's
    docstring)."""
    images = slot.model.images
    if images is None or images.name not in request.feeds:
        return request
    files = request.feeds[images.name]
    where = (
        f"the body ({request.content_type})"
        if isinstance(request, FileRequest)
        else f"input '{images.name}' element {{i}}"
    )
    # Headers first, here: what the pixels will take, not the files' bytes (a small file can hold a
    # large image), decides whether they are decoded on this loop or in a decoding thread.
    opened = [opened_file(data, where.format(i=i)) for i, data in enumerate(files.reshape(-1))]
    pixels = sum(image.size[0] * image.size[1] * len(image.getbands()) for image in opened)
    rows = await server.decode(
        partial(tensors_of, images.preprocessing, opened, files.shape, where), pixels
    )
    feeds = {k: v for k, v in request.feeds.items() if k != images.name}
    return replace(request, feeds={**feeds, images.target: rows})


def opened_file(data: bytes, where: str):
    """images.decode (the header read); BadRequest naming the file (`where`) that is not an image or
    too large."""
    try:
        return decode(data)
    except ValueError as exc:
        raise BadRequest(f"{where}: {exc}") from None


def tensors_of(preprocessing: Preprocessing, opened: list, shape: tuple, where: str) -> np.ndarray:
    """Every opened file's tensor, one row each (in `shape`, then the preprocessing's); BadRequest
    naming the file whose pixels can't be decoded (`where`, formatted with its index `i`)."""
    out = np.empty((*shape, *preprocessing.shape), np.float32)
    rows = out.reshape(-1, *preprocessing.shape)
    for i, image in enumerate(opened):
        try:
            rows[i] = applied(preprocessing, image)
        except ValueError as exc:
            raise BadRequest(f"{where.format(i=i)}: {exc}") from None
    return out


# ---- a file POSTed whole
# ----------------------------------------------------------------------------------------


def is_image(content_type: str) -> bool:
    return content_type.startswith("image/")


def takes_files(slot, content_type: str) -> ImageInput:
    """The version's image input, for a body of `content_type` (an image/ type); Refused 415 naming
    what it takes when the type is not one of CONTENT_TYPES or the version takes no images."""
    images = slot.model.images
    info = slot.model.info
    if images is None:
        raise Refused(
            415,
            f"Content-Type {content_type}: model '{info.name}' version {info.version} takes no "
            f"image files (its export recorded no image preprocessing, {PREPROCESSING}); send its "
            "inputs as tensors, application/json",
        )
    if content_type not in CONTENT_TYPES:
        raise Refused(
            415,
            f"Content-Type {content_type} is not an image type this server decodes; send "
            f"{', '.join(sorted(CONTENT_TYPES))}",
        )
    return images


def file_request(slot, data: bytes, content_type: str, classified: bool = True) -> FileRequest:
    """A POSTed file as a request of the version's image input; `classified`: its scores output
    asked as its top TOP classes (the V2 answer), else every output (/invocations ranks them:
    invocations_answer)."""
    images = takes_files(slot, content_type)
    if not data:
        raise BadRequest(f"the body is empty; send the image file's bytes as {content_type}")
    element = np.empty(1, dtype=object)
    element[0] = bytes(data)
    if images.scores is None or not classified:
        outputs, classes = [(n, False) for n in slot.model.engine.output_names], {}
    else:
        outputs, classes = [(images.scores, False)], {images.scores: TOP}
    return FileRequest(
        {images.name: element}, 1, None, outputs, classification=classes, content_type=content_type
    )


def invocations_answer(answer) -> bytes:
    """/invocations' answer to a POSTed file: its class names with their scores, best first (at most
    TOP), one list per file; the outputs as MLflow answers tensors where the version has no scores
    output."""
    model = answer.slot.model
    images = model.images
    if images is None or images.scores is None:
        return encode_mlflow(answer.results, False)
    scores = np.asarray(answer.results[images.scores], dtype=np.float64)
    scores = scores.reshape(len(scores), -1) if scores.ndim else scores.reshape(1, -1)
    labels = model.info.labels_for(images.scores, scores.shape[1])
    predictions = []
    for row in scores:
        # highest first, ties in index order (as the classification extension orders them)
        order = (len(row) - 1 - np.argsort(row[::-1], kind="stable"))[::-1][:TOP]
        predictions.append(
            [
                {"label": labels[i] if labels is not None else str(i), "score": float(row[i])}
                for i in order
            ]
        )
    return dumps({"predictions": predictions})
