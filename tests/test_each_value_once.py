"""`--each-value-once` (tests/conftest.py): of each parametrized test, a greedy cover in which every value of every
parameter runs at least once; worked by hand on small products."""
import itertools
import types

from conftest import _each_value_once


def cases(*grids: dict[str, list]) -> list[types.SimpleNamespace]:
    """Stand-ins for pytest items: one per point of each grid's product, in order, with callspec.params."""
    out = []
    for grid in grids:
        for values in itertools.product(*grid.values()):
            out.append(types.SimpleNamespace(callspec=types.SimpleNamespace(params=dict(zip(grid, values)))))
    return out


def params(chosen: list[types.SimpleNamespace]) -> list[tuple]:
    return [tuple(case.callspec.params.values()) for case in chosen]


def test_a_product_is_covered_by_its_longest_side():
    # (1,x) and (2,y) each bring two new values; z is left and (1,z) is the earliest case holding it.
    assert params(_each_value_once(cases({"a": [1, 2], "b": ["x", "y", "z"]}))) == [(1, "x"), (1, "z"), (2, "y")]


def test_one_parameter_keeps_every_case_and_the_order():
    assert params(_each_value_once(cases({"pe": ["cope", "corope", "rope"]}))) == [("cope",), ("corope",), ("rope",)]


def test_listed_cases_keep_the_one_that_alone_brings_a_value():
    # (reference, cope) and (pallas, corope) cover both columns' values but blockwise: only its one case has it.
    listed = cases({"impl": ["reference"], "pe": ["cope"]}, {"impl": ["blockwise"], "pe": ["cope"]},
                   {"impl": ["pallas"], "pe": ["corope"]})
    assert params(_each_value_once(listed)) == [("reference", "cope"), ("blockwise", "cope"), ("pallas", "corope")]


def test_unhashable_values_compare_by_repr():
    chosen = _each_value_once(cases({"options": [{"npos": 4}, {"npos": 4}, {"npos": 8}], "dtype": ["f32"]}))
    assert params(chosen) == [({"npos": 4}, "f32"), ({"npos": 8}, "f32")]
