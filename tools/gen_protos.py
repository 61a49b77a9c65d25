"""Regenerates the checked-in gRPC modules from `decoupled_diloco/comm/syncer.proto`.

  python -m tools.gen_protos

The generated `syncer_pb2*.py` are committed, so `make test` works from a fresh clone without
running this; rerun it after editing the .proto (grpcio-tools is pinned in pyproject.toml).
"""

import pathlib
import re
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = "decoupled_diloco/comm/syncer.proto"


def main() -> None:
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(ROOT / PROTO),
        ]
    )
    if rc != 0:
        sys.exit(f"protoc failed with {rc}")
    # protoc writes absolute imports from the -I root; they already match the package layout.
    grpc_module = ROOT / "decoupled_diloco/comm/syncer_pb2_grpc.py"
    text = grpc_module.read_text()
    assert re.search(r"from decoupled_diloco\.comm import syncer_pb2", text), text[:500]
    print(f"generated from {PROTO}")


if __name__ == "__main__":
    main()
