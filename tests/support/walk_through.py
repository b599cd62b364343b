"""README's walk-through as a reader runs it: its files (the blocks headed ``# NAME.py``) written into a folder and
its command block (``make_ckpt.py``, ``hpgen plan``, ``hpgen lower``, ``hpgen explain``, ``torchrun ... run.py``)
run there by bash, verbatim."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.torchrun import shims

__all__ = ["README", "WalkThrough", "run_walk_through"]

README = Path(__file__).resolve().parents[2] / "README.md"


@dataclass(frozen=True)
class WalkThrough:
    """What :func:`run_walk_through` ran and left: ``folder`` (``ckpt/``, ``plan.json``, ``modeling_llama_tp.py``)."""

    folder: Path
    bin_folder: Path  # ``python``, ``hpgen``, ``torchrun`` as this interpreter runs them
    commands: str
    done: subprocess.CompletedProcess


def run_walk_through(folder: Path, bin_folder: Path) -> WalkThrough:
    """Write README's files into ``folder`` and run its command block there (``bin_folder``: a new folder for the shims)."""
    readme = README.read_text()
    files = dict(re.findall(r"^```python\n(?=# (\w+\.py)\b)(.*?)^```", readme, re.S | re.M))
    assert set(files) == {"make_ckpt.py", "run.py"}, sorted(files)
    for name, code in files.items():
        (folder / name).write_text(code)
    (commands,) = [block for block in re.findall(r"^```bash\n(.*?)^```", readme, re.S | re.M) if "run.py" in block]
    shims(bin_folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{bin_folder}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    return WalkThrough(folder, bin_folder, commands, done)
