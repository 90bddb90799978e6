"""Builds the oncegate package: generates the gRPC stubs from the repository's proto.

The stubs are never committed. ``build_py`` runs ``grpc_tools.protoc`` on
``crates/oncegate-proto/proto/oncegate/v1/*.proto`` (found two directories up from here,
or at ``$ONCEGATE_PROTO_DIR``) into ``src/oncegate/v1/`` before the package is built, so
``pip install ./clients/python`` from the repository always ships stubs of the proto it
was built beside.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "src" / "oncegate" / "v1"


def proto_root() -> Path:
    """The directory holding ``oncegate/v1/gate.proto``."""
    configured = os.environ.get("ONCEGATE_PROTO_DIR")
    root = Path(configured) if configured else HERE.parent.parent / "crates" / "oncegate-proto" / "proto"
    if not (root / "oncegate" / "v1" / "gate.proto").is_file():
        sys.exit(
            f"oncegate: the proto files were not found at {root}/oncegate/v1/gate.proto.\n"
            "The stubs are generated at build time from the oncegate repository's proto: build "
            "from the repository (pip install ./clients/python, which builds in the source tree), "
            "or set ONCEGATE_PROTO_DIR to the repository's crates/oncegate-proto/proto."
        )
    return root


def generate() -> None:
    """Runs protoc (from grpcio-tools) on every proto of oncegate/v1."""
    try:
        from grpc_tools import protoc
    except ImportError:
        sys.exit("oncegate: grpcio-tools is needed to build (it is a build requirement in pyproject.toml)")
    import grpc_tools

    root = proto_root()
    protos = sorted(str(p.relative_to(root)) for p in (root / "oncegate" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out = str(HERE / "src")
    args = ["grpc_tools.protoc", f"-I{root}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        sys.exit(f"oncegate: protoc failed on {protos} in {root}")


class BuildWithStubs(build_py):
    """``build_py`` that generates the stubs first."""

    def run(self) -> None:
        generate()
        super().run()


def protobuf_requirement() -> str:
    """protobuf no older than the build's: generated code refuses an older runtime."""
    try:
        from google.protobuf import __version__ as version
    except ImportError:
        return "protobuf>=4.21"
    major, minor = (int(part) for part in version.split(".")[:2])
    return f"protobuf>={major}.{minor},<{major + 1}"


def grpcio_requirement() -> str:
    """grpcio no older than the build's grpcio-tools: generated stubs refuse an older one."""
    try:
        from grpc_tools.grpc_version import VERSION
    except ImportError:
        return "grpcio>=1.60"
    return f"grpcio>={VERSION}"


setup(
    cmdclass={"build_py": BuildWithStubs},
    install_requires=[grpcio_requirement(), protobuf_requirement()],
)
