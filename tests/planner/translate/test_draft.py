"""The plan while it is written (:mod:`hpgen.planner.translate.draft`): asked for an entry as the loaded plan is."""

from __future__ import annotations

from tests.support.derived_configs import tiny


def test_a_draft_finds_the_entry_the_loaded_plan_finds_for_every_module() -> None:
    from hpgen.planner.derive.derivation import derive
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.translate.derived_plan import derived_plan

    for family in ("opt", "bert"):  # wrapped column and row leaves, blocks whose output stays sharded
        model = meta_model(tiny(family))
        draft = derived_plan(model, derive(model, tp=2), tp=2, name=family)
        loaded = draft.validated()
        matched = 0
        for fqn, _ in model.named_modules():
            found, entry = (draft.entry_for(fqn), loaded.entry_for(fqn)) if fqn else (None, None)
            assert (found is None) == (entry is None), fqn
            if entry is None:
                continue
            matched += 1
            key, drafted = found
            assert key == entry.key and drafted.is_boundary == entry.is_boundary, fqn
            assert drafted.output_names == entry.output_names, fqn
            for name in entry.output_names:
                assert [layout.on("tp") for layout in drafted.output_layouts(name)] == [
                    layout.on("tp") for layout in entry.output_layouts(name, ("tp",))
                ], (fqn, name)
        assert matched >= 4, family
