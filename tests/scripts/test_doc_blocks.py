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
from tests.support.torchrun import as_under_torchrun
from tests.support.walk_through import WalkThrough

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


def _bash(commands: str, folder: Path, bin_folder: Path) -> subprocess.Popen:
    """``commands`` started in ``folder`` by bash, with the shims first on PATH (:func:`_waited` reads the result)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{bin_folder}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.Popen(["bash", "-euo", "pipefail", "-c", commands], cwd=folder, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip


def _waited(process: subprocess.Popen, commands: str) -> None:
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, f"{commands}\n{stderr[-3000:]}"


@pytest.fixture(scope="module")
def walk_through(readme_walk_through: WalkThrough) -> tuple[Path, Path, str]:
    """README's walk-through, run as written (the session's ``readme_walk_through``): ``make_ckpt.py`` run,
    ``plan.json`` planned, ``modeling_llama_tp.py`` lowered; and its ``MODELING=`` line."""
    done = readme_walk_through.done
    assert done.returncode == 0, f"README's walk-through failed:\n{done.stderr[-3000:]}"
    (modeling,) = re.findall(r"^MODELING=.*$", (REPO / "README.md").read_text(), re.M)
    return readme_walk_through.folder, readme_walk_through.bin_folder, modeling


@pytest.fixture(scope="module")
def page_folders(walk_through, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Page -> its folder: README's files, then the page's own commands, then its file blocks written out. The
    pages' commands run side by side (each page's in order, in its own folder): each is a fresh interpreter
    importing torch and transformers on one core."""
    base, bin_folder, modeling = walk_through
    folders, started = {}, []
    for page in PAGES:
        page_programs = [program for program in PROGRAMS.values() if program.page == page.name]
        if not page_programs:
            continue
        folder = tmp_path_factory.mktemp(page.stem)
        shutil.copytree(base, folder, dirs_exist_ok=True)
        if setup_commands(page):
            commands = "\n".join([modeling, *setup_commands(page)])
            started.append((_bash(commands, folder, bin_folder), commands))
        for program in page_programs:
            for block in program.blocks:
                if block.file is not None:
                    (folder / block.file).write_text(block.runnable())
        folders[page.name] = folder
    try:
        for process, commands in started:
            _waited(process, commands)
    finally:
        for process, _ in started:  # after a failure: the other pages' commands
            if process.poll() is None:
                process.kill()
                process.wait()
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
