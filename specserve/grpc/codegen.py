"""Regenerate specserve_pb2.py and specserve_pb2_grpc.py from specserve.proto with grpcio-tools
(`python -m specserve.grpc.codegen`). The generated code is committed so that installs need no
protoc; tests/test_grpc_codegen.py regenerates it and fails when the committed copy differs."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding specserve/
PROTO = "specserve/grpc/specserve.proto"
GENERATED = ("specserve/grpc/specserve_pb2.py", "specserve/grpc/specserve_pb2_grpc.py")


def generate(out_dir: Path) -> dict[str, str]:
    """Run protoc (grpcio-tools) into `out_dir`; returns {relative path: generated text}."""
    from grpc_tools import protoc

    code = protoc.main(["grpc_tools.protoc", f"-I{PACKAGE_ROOT}", f"--python_out={out_dir}",
                        f"--grpc_python_out={out_dir}", str(PACKAGE_ROOT / PROTO)])
    if code != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {code})")
    return {name: (out_dir / name).read_text() for name in GENERATED}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generate(Path(tmp)).items():
            (PACKAGE_ROOT / name).write_text(text)
            print(f"wrote {name}", file=sys.stderr)


if __name__ == "__main__":
    main()
