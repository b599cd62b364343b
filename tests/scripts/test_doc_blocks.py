"""Every Python block of README.md and docs/*.md that runs a job runs, as written, on gloo ranks on the CPU.

The blocks of a page become programs as :mod:`tests.support.doc_blocks` says (a file block
as its own script, the others as the page's walk-through, a block with a mesh of another
rank count alone after the lines it reads); each runs on its ranks under torchrun's
environment (:func:`tests.support.torchrun.as_under_torchrun`), in a folder made the way
README's walk-through makes it plus the page's own ``hpgen plan`` / ``hpgen lower`` commands.
A page added to docs/ is picked up by itself; a block that is not run must say why
(:data:`tests.support.doc_blocks.NOT_RUN`, :data:`~tests.support.doc_blocks.RUN_ELSEWHERE`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.doc_blocks import Program, not_run, page_blocks, programs, setup_commands
from tests.support.torchrun import as_under_torchrun, shims

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = {program.name: program for page in PAGES for program in programs(page)}


def _run_program(rank: int, world_size: int, folder: str, program: Program) -> dict[str, Any]:
    """Rank body: the program's blocks in one namespace, as ``__main__`` under torchrun, in ``folder``."""
    import contextlib
    import io
    import sys
    import traceback

    as_under_torchrun(rank, world_size)
    os.chdir(folder)
    sys.path.insert(0, folder)  # torchrun puts the script's folder first: `import modeling_llama_tp` finds it
    namespace: dict[str, Any] = {"__name__": "__main__"}
    ran = []
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            if program.prelude:
                exec(compile(program.prelude, f"{program.name} (the lines it reads from the blocks above)", "exec"), namespace)
            for block in program.blocks:
                if block.file is not None:
                    sys.argv = [block.file]
                    namespace["__file__"] = os.path.join(folder, block.file)
                    source, where = Path(block.file).read_text(), os.path.join(folder, block.file)
                else:
                    source, where = block.runnable(), block.label
                exec(compile(source, where, "exec"), namespace)
                ran.append(block.label)
        except BaseException:  # noqa: BLE001 - reported with the block that raised
            return {"ran": ran, "error": traceback.format_exc()[-4000:], "printed": printed.getvalue()[-2000:]}
    return {"ran": ran, "error": None, "printed": printed.getvalue()[-2000:]}


def _sh(commands: str, folder: Path, bin_folder: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{bin_folder}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{commands}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def walk_through(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """README's walk-through up to its run: ``make_ckpt.py`` run, ``plan.json`` planned, ``modeling_llama_tp.py`` lowered."""
    folder = tmp_path_factory.mktemp("readme")
    bin_folder = shims(tmp_path_factory.mktemp("bin") / "bin")
    readme = REPO / "README.md"
    (make_ckpt,) = [block for block in page_blocks(readme) if block.file == "make_ckpt.py"]
    (folder / "make_ckpt.py").write_text(make_ckpt.code)
    (modeling,) = re.findall(r"^MODELING=.*$", readme.read_text(), re.M)
    _sh("\n".join(["python make_ckpt.py", modeling, *setup_commands(readme)]), folder, bin_folder)
    return folder, bin_folder, modeling


@pytest.fixture(scope="module")
def page_folders(walk_through, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Page -> its folder: README's files, then the page's own commands, then its file blocks written out."""
    base, bin_folder, modeling = walk_through
    folders = {}
    for page in PAGES:
        page_programs = [program for program in PROGRAMS.values() if program.page == page.name]
        if not page_programs:
            continue
        folder = tmp_path_factory.mktemp(page.stem)
        shutil.copytree(base, folder, dirs_exist_ok=True)
        if setup_commands(page):
            _sh("\n".join([modeling, *setup_commands(page)]), folder, bin_folder)
        for program in page_programs:
            for block in program.blocks:
                if block.file is not None:
                    (folder / block.file).write_text(block.runnable())
        folders[page.name] = folder
    return folders


def test_every_block_is_run_or_says_why() -> None:
    """Each block of each page is in a program here, or names the test that runs it / why it is no job."""
    run = {block.label for program in PROGRAMS.values() for block in program.blocks}
    for page in PAGES:
        for block in page_blocks(page):
            assert block.label in run or not_run(block), block.label
    assert {"checkpoints.md", "context-parallel.md", "lora.md", "runtime.md", "training.md"} <= {
        program.page for program in PROGRAMS.values()
    }


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_blocks_run_as_written(name: str, page_folders: dict[str, Path]) -> None:
    program = PROGRAMS[name]
    folder = page_folders[program.page]
    results = run_distributed(_run_program, str(folder), program, world_size=program.ranks, timeout=600)
    for rank, result in enumerate(results):
        assert result["error"] is None, f"rank {rank} of {program.ranks}, after {result['ran']}:\n{result['error']}"
        assert result["ran"] == [block.label for block in program.blocks]
