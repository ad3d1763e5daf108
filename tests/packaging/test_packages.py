"""The wheel ships every package of the source tree: the package list in pyproject.toml is explicit
(the import package is the repo root), so a new package that is not listed would work in an
editable install and be missing from `pip install gpuguard`."""

from __future__ import annotations

import tomllib

from tests.support.cli import REPO

DATA_ONLY = {"foundation/data", "collectors/data", "diagnostics/data", "recovery/operator/runbooks"}
NOT_SHIPPED = {"tests", "bench", "docs", "build", "dist"}


def _source_packages() -> set[str]:
    found = {"gpuguard"}
    for init in REPO.rglob("__init__.py"):
        rel = init.parent.relative_to(REPO)
        if not rel.parts or rel.parts[0] in NOT_SHIPPED or rel.parts[0].startswith("."):
            continue
        found.add("gpuguard." + ".".join(rel.parts))
    return found | {"gpuguard." + d.replace("/", ".") for d in DATA_ONLY}


def test_every_source_package_is_listed_for_the_wheel() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert _source_packages() == listed


def test_torch_is_not_a_base_dependency() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.replace(" ", "").startswith("torch")]
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["runtime"])
