"""Generate the committed Python stubs from protos/, or check that they are up to date.

Usage: python scripts/gen_protos.py [--check]
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_PACKAGE = Path("maskwire") / "v1"


def _googleapis_include() -> str:
    """Directory holding google/rpc/*.proto (shipped by googleapis-common-protos)."""
    import google.rpc

    return str(Path(google.rpc.__path__[0]).parent.parent)


def generate(out_root: Path) -> None:
    protos = sorted(
        str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "maskwire/v1").glob("*.proto")
    )
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{_googleapis_include()}",
        f"-I{resources.files('grpc_tools') / '_proto'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs differ")
    check = parser.parse_args().check
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / OUT_PACKAGE
        names = sorted(p.name for p in fresh.iterdir() if p.is_file())
        committed = ROOT / OUT_PACKAGE
        if check:
            stale = [
                n
                for n in names
                if not (committed / n).exists()
                or not filecmp.cmp(fresh / n, committed / n, shallow=False)
            ]
            if stale:
                sys.exit(f"generated stubs are stale: {stale}; run `make protos`")
            print(f"stubs up to date ({len(names)} files)")
            return
        committed.mkdir(parents=True, exist_ok=True)
        for n in names:
            shutil.copyfile(fresh / n, committed / n)
        print(f"wrote {len(names)} files to {committed}")


if __name__ == "__main__":
    main()
