"""Which layer feeds which: an abstract run of the ``forward`` bodies of a module tree.

The derived planner needs to know, inside one decoder layer, that ``o_proj`` consumes
what ``q_proj``/``k_proj``/``v_proj`` produced (through the attention), that ``fc2``
consumes ``fc1`` (through an activation), and whether a module's return value comes from
its output projection alone or also from its input (a residual added inside). This
module answers that from the source, without running any tensor code:

- :func:`run_module` interprets a module's ``forward`` (and the methods of its own class
  it calls) over abstract values: each value is the set of *origins* it was computed
  from, an origin being a leaf layer (``nn.Linear``, ``Conv1D``, a norm: a module whose
  ``forward`` is not in the modeling file, or one that holds parameters of its own) or a
  marker ``in:<name>`` for a ``forward`` parameter. Arithmetic, tensor methods and
  functions (the attention kernel, activations, rotary) mix their operands' origins; a
  call of a child module defined in the file is interpreted in turn, with its own
  instance, so ``self.mlp(x)`` is followed into ``mlp.down_proj``.
- Every call of a leaf is an *edge* (origins of its input -> the leaf); every shape call
  (``view``, ``reshape``, ``split``, ``chunk``...) is recorded with the origins of the
  tensor it reshapes and the module attributes its arguments read (``self.num_heads``),
  which is how the planner finds a fused projection's layout and the attributes that hold
  global head counts.
- ``if`` tests that read only module attributes and constants (``self.multi_query``,
  ``self.config._attn_implementation == "sdpa"``) take the branch the instance takes;
  other tests take both, merged.

The interpretation over-approximates (a value may list an origin it does not depend on),
never the reverse for the constructs it understands; an unknown construct mixes all its
operands. torch is imported only for ``isinstance`` checks on the live instance.

The interpreter's parts: :mod:`~hpgen.planner.flow.values` (the abstract values and what
a run records), :mod:`~hpgen.planner.flow.runner` (module calls: which modules are
leaves, binding arguments, finding a method's source), and the body of one function,
:class:`~hpgen.planner.flow.statements.Frame`, with its
:mod:`~hpgen.planner.flow.expressions` and :mod:`~hpgen.planner.flow.constants` (the
values of branch tests); :mod:`~hpgen.planner.flow.module_level` says which class statements
are read and which the lowering rewrites; :mod:`~hpgen.planner.flow.functions` follows the
file's tuple-returning functions item by item and in-place tensor methods, and
:mod:`~hpgen.planner.flow.protocols` types what a frame asks of its run and a call of a
frame;
:mod:`~hpgen.planner.flow.caller_nones` says which arguments a decoder layer's caller
passes as None, so that a branch on one is read the way the instance takes it.
"""

from hpgen.planner.flow.module_level import top_level_class
from hpgen.planner.flow.runner import leaf_kind, module_names, run_module
from hpgen.planner.flow.values import EMPTY, SIZE, Flow, ShapeUse, Val, merge, union

__all__ = [
    "EMPTY",
    "SIZE",
    "Flow",
    "ShapeUse",
    "Val",
    "leaf_kind",
    "merge",
    "module_names",
    "run_module",
    "top_level_class",
    "union",
]
