"""Print the `maskwire` distribution's dependencies (pyproject.toml), one a line, for `pip install
-r`. The images install them in a layer of their own, rebuilt only when pyproject.toml changes, and
the code after them without dependencies. `--without NAME` leaves a dependency out: torch, which
the grammar service and the gateway never import."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    p.add_argument("--without", action="append", default=[], metavar="NAME")
    args = p.parse_args()
    project = tomllib.loads(args.pyproject.read_text())["project"]
    left_out = {name.lower() for name in args.without}
    for dep in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9._-]+", dep)
        if name is None or name.group().lower() not in left_out:
            print(dep)


if __name__ == "__main__":
    main()
