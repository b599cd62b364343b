"""The model the planner reads: its config, its instance on the meta device, small questions about its modules.

- ``hpgen.planner.model.load``: the config, the model on the meta device, the modeling file its class comes from;
- ``hpgen.planner.model.modules``: small questions about modules (linear or not, widths, common parents, names).
"""
