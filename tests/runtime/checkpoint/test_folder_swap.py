"""Replacing a checkpoint folder in one step, its fallback, and the recovery rule (one process, no ranks).

The killed 2-rank saves are in ``test_checkpoints.py`` (``checkpoint_kills.py``); these are the
folder operations themselves: what stays and what goes on success, on an error, after a crash
between the fallback's two renames, through a symbolic link.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hpgen.core import durable
from hpgen.runtime.checkpoint import folder_swap


def _folder(path: Path, **files: str) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _listing(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_the_new_folder_replaces_the_old_one_and_nothing_is_left_beside_it(tmp_path, monkeypatch, exchange) -> None:
    if not exchange:
        monkeypatch.setattr(durable, "exchange", lambda first, second: False)
    target = _folder(tmp_path / "ckpt", **{"a.txt": "old", "gone.txt": "old"})
    os.chmod(target, 0o750)
    with folder_swap.replacing(target) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".ckpt.hpgen-new-")
        assert _listing(target) == {"a.txt": "old", "gone.txt": "old"}  # untouched until the swap
        (staging / "a.txt").write_text("new")
    assert _listing(target) == {"a.txt": "new"}
    assert target.stat().st_mode & 0o777 == 0o750  # the folder keeps its permissions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_an_error_while_writing_leaves_the_old_folder_and_no_temporary_one(tmp_path) -> None:
    target = _folder(tmp_path / "ckpt", **{"a.txt": "old"})
    with pytest.raises(RuntimeError, match="disk full"):
        with folder_swap.replacing(target) as staging:
            (staging / "a.txt").write_text("half")
            raise RuntimeError("disk full")
    assert _listing(target) == {"a.txt": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_crash_between_the_two_renames_is_recovered_and_leftovers_are_deleted(tmp_path) -> None:
    # what the fallback leaves when killed after its first rename: no target, the old folder beside it
    _folder(tmp_path / ".ckpt.hpgen-old-x1", **{"a.txt": "old"})
    _folder(tmp_path / ".ckpt.hpgen-new-x1", **{"a.txt": "new"})
    assert folder_swap.recover(tmp_path / "ckpt")
    assert _listing(tmp_path / "ckpt") == {"a.txt": "old"}
    assert [p.name for p in folder_swap.leftovers(tmp_path / "ckpt")] == [".ckpt.hpgen-new-x1"]
    assert not folder_swap.recover(tmp_path / "ckpt")  # the target is there: nothing to do
    with folder_swap.replacing(tmp_path / "ckpt") as staging:  # the next save deletes the leftovers
        (staging / "a.txt").write_text("newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert _listing(tmp_path / "ckpt") == {"a.txt": "newer"}


def test_a_symbolic_link_is_followed(tmp_path) -> None:
    real = _folder(tmp_path / "real", **{"a.txt": "old"})
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with folder_swap.replacing(tmp_path / "link") as staging:
        (staging / "a.txt").write_text("new")
    assert (tmp_path / "link").is_symlink() and _listing(real) == {"a.txt": "new"}


def test_a_first_save_creates_the_folder_and_its_parents(tmp_path) -> None:
    with folder_swap.replacing(tmp_path / "runs" / "ckpt") as staging:
        (staging / "a.txt").write_text("new")
    assert _listing(tmp_path / "runs" / "ckpt") == {"a.txt": "new"}
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["ckpt"]


def test_exchange_swaps_two_folders() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        first, second = _folder(Path(tmp) / "a", x="1"), _folder(Path(tmp) / "b", y="2")
        swapped = durable.exchange(first, second)
        if sys.platform != "linux":
            assert not swapped  # elsewhere: the two-rename fallback, tested above
            return
        assert swapped and _listing(first) == {"y": "2"} and _listing(second) == {"x": "1"}
