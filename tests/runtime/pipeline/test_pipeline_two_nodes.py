"""A job started the way two nodes start one: two torchrun launches meeting at one c10d rendezvous.

Each launch is a "node" of 2 ranks on this machine; the mesh (pp 2, tp 2) puts a stage on
each node and tensor parallelism within it, so the stages' hand-overs cross the "nodes".
Nothing in hpgen may assume one node (local ranks, device indices, shared memory): the
example checks the loss, the gradient norm and greedy generation against the unsharded model.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pipeline_llama.py"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_torchrun_nodes_run_a_stage_each():
    port = _free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pipeline-test", str(EXAMPLE),
    ]
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    # found anywhere in a line: the ranks share their node's pipe with torchrun's and the other ranks' unbuffered
    # stderr (warnings written piecewise), so a report line may follow another process's unfinished line
    lines = [line for output in outputs for line in re.findall(r"rank \d+ \(node \d, stage \d\): [^\n]*", output)]
    assert len(lines) == 4, outputs
    stages_by_node: dict[str, set[str]] = {}
    for line in lines:
        node, stage = re.search(r"\(node (\d), stage (\d)\)", line).groups()
        stages_by_node.setdefault(node, set()).add(stage)
        loss, want = map(float, re.search(r"loss ([\d.]+) \(unsharded ([\d.]+)\)", line).groups())
        assert abs(loss - want) <= 1e-5 and "generate matches" in line, line
    assert sorted(stages_by_node) == ["0", "1"] and all(len(stages) == 1 for stages in stages_by_node.values())
    assert stages_by_node["0"] != stages_by_node["1"]  # one stage a node: the hand-overs cross nodes
