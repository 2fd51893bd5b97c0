"""The compiled parts, both optional (a failed build leaves a slower pure-Python path, never a
failed install):

- serving._ingest (serving/_ingest.c, needs only a C compiler and Python's headers): one pass over a
  request's tensor bytes, the copy into the batch and the NaN/Inf check fused; without it numpy does
  both (two passes).
- serving.grpc._native, the gRPC front end on grpc's C++ server (serving/grpc/native.cc): built
  where grpc's C++ library and pkg-config are installed (Debian/Ubuntu: `apt-get install
  libgrpc++-dev pkg-config`; scripts/setup does it as root); elsewhere the server's gRPC runs on
  grpc.aio (`--grpc-engine auto`).

Everything else is in pyproject.toml.
"""

import shlex
import subprocess

from setuptools import Extension, setup


def grpc_flags() -> tuple[list[str], list[str]] | None:
    """grpc++'s compile and link flags from pkg-config, or None where it is not installed."""
    try:
        cflags, libs = (
            subprocess.run(
                ["pkg-config", flag, "grpc++"], capture_output=True, text=True, check=True
            ).stdout
            for flag in ("--cflags", "--libs")
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return shlex.split(cflags), shlex.split(libs)


flags = grpc_flags()
extensions = [
    Extension("serving._ingest", ["serving/_ingest.c"], extra_compile_args=["-O3"], optional=True)
]
# a failed build leaves grpc.aio serving, not a failed install
extensions += (
    []
    if flags is None
    else [
        Extension(
            "serving.grpc._native",
            ["serving/grpc/native.cc"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", *flags[0]],
            extra_link_args=flags[1],
            optional=True,
        )
    ]
)
setup(ext_modules=extensions)
