"""`pipeline serve`: the inference server, exactly as `python -m serving` runs it.

The server lives in `serving/` and imports neither torch nor this package; this module only
hands it the command line.
"""

# the stage interface pipeline.cli expects
from serving.cli import add_arguments, cli  # noqa: F401
