"""How often a 2-rank gloo script aborts at exit (SIGABRT, "terminate called without an active exception").

    python benchmarks/gloo_exit_abort.py [--runs 10]

torch alone, no hpgen or transformers: each variant is a tiny torchrun script that makes a gloo
process group (and a DeviceMesh), runs 50 all-reduces and exits in a different way. It shows
that the abort seen at the end of Trainer runs is torch/gloo's teardown of process groups still
alive at interpreter exit, and which endings avoid it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BODY = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")) if {mesh} else None
t = torch.ones(1000)
for _ in range(50):
    dist.all_reduce(t)
    if mesh is not None:
        dist.all_reduce(t, group=mesh.get_group("tp"))
{ending}
"""
VARIANTS = {
    "default group, no destroy": (False, ""),
    "default group, destroy_process_group()": (False, "dist.destroy_process_group()"),
    "DeviceMesh, no destroy": (True, ""),
    "DeviceMesh, destroy_process_group()": (True, "dist.destroy_process_group()"),
    "DeviceMesh, barrier + destroy": (True, "dist.barrier()\ndist.destroy_process_group()"),
    "DeviceMesh, del mesh + gc + destroy": (True, "del mesh\nimport gc\ngc.collect()\ndist.destroy_process_group()"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    runs = parser.parse_args().runs
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"| exit | aborted (of {runs}) |\n|---|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for name, (mesh, ending) in VARIANTS.items():
            script = Path(folder) / "script.py"
            script.write_text(BODY.format(mesh=mesh, ending=ending))
            aborted = 0
            for _ in range(runs):
                done = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                    capture_output=True, text=True, env=env, timeout=120,
                )  # fmt: skip
                aborted += "SIGABRT" in done.stderr or "terminate called" in done.stderr
            print(f"| {name} | {aborted} |")


if __name__ == "__main__":
    main()
