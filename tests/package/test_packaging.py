"""The wheel ships every package of the source tree (an editable install would hide a missing one)."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the backport pyproject.toml installs there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_under_hpgen_is_listed_for_the_wheel() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "hpgen").rglob("__init__.py")
    }
    assert found - listed == set(), "packages missing from [tool.setuptools] packages in pyproject.toml"
    assert "hpgen.templates" in listed
