"""Survey and install: what ``parallelize`` runs, every check before any tensor changes.

- ``hpgen.runtime.install.parallelize``: ``parallelize(model, plan, mesh)``, the steps in order;
- ``hpgen.runtime.install.pretrained``: ``from_pretrained``, parallelizing a model built on the meta device and
  reading its checkpoint into the shards before any hook is attached;
- ``hpgen.runtime.install.agreement``: every rank runs the same plan, generated file and hpgen;
- ``hpgen.runtime.install.launch_checks``: launch mistakes named as such (a rank outside the mesh, a plan for
  another size or model class, a batch split beside whole companion inputs);
- ``hpgen.runtime.install.module_decisions``: what each planned module is, decided once by the survey (its form,
  class, movers, shard layouts, vocab rows): the record the install, hooks, streams and checks read;
- ``hpgen.runtime.install.module_installs``: doing what a module's record says (class swap, bindings);
- ``hpgen.runtime.install.counterparts``: the generated class of a module built from the original file;
- ``hpgen.runtime.install.params``: planned parameters found, checked, then cut to this rank's chunk;
- ``hpgen.runtime.install.attrs``: module attributes that must follow the local shards;
- ``hpgen.runtime.install.groups``: the replica process groups of an ``RS(d,r)`` placement;
- ``hpgen.runtime.install.hooks``: deferred biases and gradient reductions of a sharded body;
- ``hpgen.runtime.install.summed``: what a summed reduction (a parallel-residual block) adds;
- ``hpgen.runtime.install.kernels``: keep the generated forward where transformers picks one at run time;
- ``hpgen.runtime.install.replaced_stubs``: refuse a forward that would hand shards to a fused kernel;
- ``hpgen.runtime.install.inputs``: the check that each axis's ranks were fed the same inputs;
- ``hpgen.runtime.install.tuners``: peft's tuner layers as a plan sees them, and the methods refused;
- ``hpgen.runtime.install.adapters``: peft's LoRA adapters laid out like their base layers;
- ``hpgen.runtime.install.wrapped``: the mesh a model was parallelized on, and the refusal of a DDP spanning its plan axes.
- ``hpgen.runtime.install.stock_loops``: a stock ``transformers.Trainer`` or ``Accelerator.prepare`` refused at the first
  thing each reads of a parallelized model.
- ``hpgen.runtime.install.context_checks``: what a ``cp`` axis refuses, and decode steps run replicated on it.
"""
