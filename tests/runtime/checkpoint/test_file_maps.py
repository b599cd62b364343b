"""Boxes of safetensors tensors read as views of just their bytes (one process, no ranks).

The 2-rank loads of whole checkpoints are in ``test_checkpoints.py``; these check the
reader itself against safetensors' own ``load_file``: every box of every dtype exact,
column boxes strided over a mapping of only the bytes they span, mappings gone when the
last view is freed, and no file descriptor left behind.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hpgen.runtime.checkpoint.checkpoint_files import CheckpointFiles
from hpgen.runtime.checkpoint.file_maps import box_view, read_header

TENSORS = {  # odd sizes so that boxes start and end inside pages
    "f32": (torch.float32, (37, 1029)),
    "bf16": (torch.bfloat16, (3, 41, 517)),
    "f16": (torch.float16, (2053,)),
    "i64": (torch.int64, (5, 7, 3, 11)),
    "bool": (torch.bool, (19, 23)),
    "u8": (torch.uint8, (4099,)),
}


def _write(path: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (dtype, shape) in TENSORS.items():
        values = torch.randn(shape, generator=generator) * 100
        tensors[name] = values > 0 if dtype == torch.bool else values.to(dtype)
    save_file(tensors, path)
    return _load(path)


def _load(path: Path) -> dict[str, torch.Tensor]:
    """safetensors' own reading of the file, as copies (its tensors map the whole file)."""
    loaded = {name: tensor.clone() for name, tensor in load_file(path).items()}
    gc.collect()
    return loaded


def _boxes(shape: tuple[int, ...], generator: torch.Generator) -> list[tuple[tuple[int, int], ...]]:
    """Whole tensor, first and last rows, columns (an inner cut), and random boxes."""
    whole = tuple((0, n) for n in shape)
    found = [whole, ((0, shape[0] // 2),) + whole[1:], ((shape[0] // 2, shape[0]),) + whole[1:]]
    if len(shape) > 1:
        found.append(whole[:-1] + ((shape[-1] // 2, shape[-1]),))  # S(-1): every row's right half
        found.append(whole[:-1] + ((1, 2),))  # one column
    for _ in range(8):
        box = []
        for n in shape:
            a, b = sorted(torch.randint(0, n + 1, (2,), generator=generator).tolist())
            box.append((a, max(b, a + 1) if a < n else n))
        found.append(tuple(box))
    return found


def _mapped_bytes(path: Path) -> int:
    """Bytes of ``path`` this process has mapped (``/proc/self/maps``)."""
    total = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            total += stop - start
    return total


def test_every_box_of_every_dtype_is_the_tensors_elements(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    expected = _write(path)
    generator = torch.Generator().manual_seed(1)
    fd = os.open(path, os.O_RDONLY)
    try:
        stored = read_header(fd)
        for name, full in expected.items():
            assert stored[name].dtype == full.dtype and stored[name].shape == tuple(full.shape)
            for box in _boxes(tuple(full.shape), generator):
                view = box_view(fd, stored[name], box)
                want = full[tuple(slice(a, b) for a, b in box)]
                assert view.dtype == want.dtype and view.shape == want.shape, (name, box)
                assert torch.equal(view, want), (name, box)
                as_float = torch.empty(want.shape, dtype=torch.float32)
                as_float.copy_(view)  # the cast on the way a bf16 -> f32 load takes
                assert torch.equal(as_float, want.to(torch.float32)), (name, box)
    finally:
        os.close(fd)


def test_a_column_box_is_strided_over_only_the_bytes_it_spans_and_unmapped_when_freed(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    expected = _write(path)
    rows, cols = TENSORS["f32"][1]
    with CheckpointFiles(tmp_path) as files:
        before = _mapped_bytes(path)
        right = files.read("f32", ((0, rows), (cols // 2, cols)))
        assert not right.is_contiguous() and torch.equal(right, expected["f32"][:, cols // 2 :])
        spanned = ((rows - 1) * cols + cols - cols // 2) * 4
        assert 0 < _mapped_bytes(path) - before <= spanned + 2 * 4096
        assert files.view("f32", ((0, rows), (cols // 2, cols))) is None  # columns are copied, never kept
        rows_view = files.view("f32", ((0, rows // 2), (0, cols)))
        assert rows_view is not None and rows_view.is_contiguous()
        del right
        gc.collect()
        assert _mapped_bytes(path) - before <= (rows // 2) * cols * 4 + 2 * 4096  # the rows' view only
    rows_view.add_(1)  # copy-on-write: the file does not change, and the view outlives the files' closing
    assert torch.equal(rows_view, expected["f32"][: rows // 2] + 1)
    assert torch.equal(_load(path)["f32"], expected["f32"])
    del rows_view
    gc.collect()
    assert _mapped_bytes(path) == 0


def test_no_file_descriptor_outlives_the_folder(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    _write(path)

    def open_on_file() -> int:
        return sum(os.path.realpath(f"/proc/self/fd/{fd}") == str(path.resolve()) for fd in os.listdir("/proc/self/fd"))

    with CheckpointFiles(tmp_path) as files:
        views = [files.view("f32"), files.view("u8", ((0, 4096),))]
        assert views[0] is not None and open_on_file() == 1
    assert views[1] is None  # 4 KiB: under VIEW_MIN_BYTES, copied
    assert open_on_file() == 0 and _mapped_bytes(path) > 0


@pytest.mark.parametrize("index", [((0, 2), (0, 3)), ((0, 0), (0, 1029))], ids=["small", "empty"])
def test_small_and_empty_boxes_are_not_views(tmp_path: Path, index: tuple[tuple[int, int], ...]) -> None:
    expected = _write(tmp_path / "model.safetensors")
    with CheckpointFiles(tmp_path) as files:
        assert files.view("f32", index) is None
        box = files.read("f32", index)
        assert torch.equal(box, expected["f32"][index[0][0] : index[0][1], index[1][0] : index[1][1]])
