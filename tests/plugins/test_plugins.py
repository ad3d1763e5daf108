"""Entry-point plugins: built-ins register like third-party ones; broken plugins are reported, skipped."""

from __future__ import annotations

import json
import textwrap

import pytest

from gpuguard.plugins import registry  # noqa: E402
from tests.support.cli import run_cli
from tests.support.node import sample_sweep_argv

BUILTIN_OUTPUTS = {"json", "prometheus", "npd", "webhook"}


@pytest.fixture
def third_party(tmp_path):
    """A tiny third-party distribution, installed the way pip lays it out (module + .dist-info), on a
    throwaway path given to the child processes through PYTHONPATH: the shared venv is not modified."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "tp_gpuguard_plugin.py").write_text(
        textwrap.dedent("""
        import json
        from gpuguard.plugins.outputs import Output

        class FileOutput(Output):
            name = "tp-file"
            def emit(self, document):
                with open(self.options["path"], "w") as fh:
                    json.dump({"verdict": document["verdict"], "gpus": len(document["gpus"])}, fh)
                return "written"

        class RaisingOutput(Output):
            def emit(self, document):
                raise RuntimeError("notifier exploded")

        def collect():
            return {"status": "ok"}
    """)
    )
    (site / "tp_gpuguard_broken.py").write_text('raise RuntimeError("boom at import")\n')
    info = site / "tp_gpuguard_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tp-gpuguard-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent("""
        [gpuguard.outputs]
        tp-file = tp_gpuguard_plugin:FileOutput
        tp-raises = tp_gpuguard_plugin:RaisingOutput
        tp-broken = tp_gpuguard_broken:Output

        [gpuguard.collectors]
        tp-collector = tp_gpuguard_plugin:collect
    """)
    )
    (info / "RECORD").write_text("")
    return {"PYTHONPATH": str(site)}, tmp_path


def test_builtin_outputs_are_entry_points():
    found = {p.name: p for p in registry.discover(("gpuguard.outputs",))}
    assert BUILTIN_OUTPUTS <= set(found)
    for name in BUILTIN_OUTPUTS:
        assert found[name].status == "ok" and found[name].distribution == "gpuguard"
        assert found[name].target.startswith("gpuguard.plugins.outputs:")


def test_plugins_command_lists_third_party_and_reports_the_broken_one(third_party):
    env, _ = third_party
    r = run_cli("gpu-doctor", "plugins", "--json", env=env)
    assert r.returncode == 0, r.stderr
    plugins = {(p["group"], p["name"]): p for p in json.loads(r.stdout)["plugins"]}
    assert plugins[("gpuguard.outputs", "tp-file")]["status"] == "ok"
    assert plugins[("gpuguard.outputs", "tp-file")]["distribution"] == "tp-gpuguard-plugin"
    assert plugins[("gpuguard.collectors", "tp-collector")]["status"] == "ok"
    broken = plugins[("gpuguard.outputs", "tp-broken")]
    assert broken["status"] == "failed" and "boom at import" in broken["error"]
    human = run_cli("gpu-doctor", "plugins", env=env)
    assert "tp-file" in human.stdout and "boom at import" in human.stdout


def test_sweep_runs_good_plugins_and_survives_bad_ones(third_party):
    env, tmp_path = third_party
    out = tmp_path / "tp.json"
    argv = sample_sweep_argv(
        tmp_path / "state", "tp-raises", "tp-broken", "tp-missing", "tp-file", options=(f"tp-file.path={out}",)
    )
    r = run_cli(*argv, env=env)
    assert r.returncode == 2, r.stderr  # the node's verdict (drain), whatever the plugins did
    results = {o["name"]: o for o in json.loads(r.stdout)["outputs"]}
    assert results["tp-file"]["status"] == "ok" and json.loads(out.read_text()) == {"verdict": "drain", "gpus": 4}
    assert results["tp-raises"]["status"] == "failed" and "notifier exploded" in results["tp-raises"]["message"]
    assert results["tp-broken"]["status"] == "failed" and "boom at import" in results["tp-broken"]["message"]
    assert results["tp-missing"]["status"] == "failed" and "no such plugin" in results["tp-missing"]["message"]
    assert "Traceback" not in r.stderr and r.stderr.count("output ") == 3


def test_builtin_json_output_through_the_registry(tmp_path):
    loaded, failures = registry.load("gpuguard.outputs", ["json"])
    assert failures == []
    path = tmp_path / "doc.json"
    result = registry.run_safely(
        "gpuguard.outputs", "json", lambda: loaded["json"]({"path": str(path)}).emit({"schema": "x", "verdict": "ok"})
    )
    assert result.status == "ok" and json.loads(path.read_text())["verdict"] == "ok"
    bad = registry.run_safely(
        "gpuguard.outputs",
        "prometheus",
        lambda: registry.load("gpuguard.outputs", ["prometheus"])[0]["prometheus"]({}).emit({}),
    )
    assert bad.status == "failed" and "needs path" in bad.message
