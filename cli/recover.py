"""`gpu-recover`: drive recovery against a running torchrun job."""

from __future__ import annotations

from gpuguard.cli import recover_demo
from gpuguard.cli._app import entry, make_app

app = make_app(
    "gpu-recover",
    "Recover a torchrun job: abort, re-rendezvous, restore, verify; alone or as YAML runbooks.",
)

recover_demo.register(app=app)

main = entry(app, "gpu-recover")

if __name__ == "__main__":
    main()
