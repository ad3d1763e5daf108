"""`gpu-generation`: show and verify generation certificates."""

from __future__ import annotations

from gpuguard.cli import generation_bench
from gpuguard.cli._app import entry, make_app

app = make_app(
    "gpu-generation",
    "Generation certificates: membership (incarnations) + commit frontier + state digest + ownership, certified together.",
)

generation_bench.register(app=app)

main = entry(app, "gpu-generation")

if __name__ == "__main__":
    main()
