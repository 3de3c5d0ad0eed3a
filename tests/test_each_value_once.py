"""`--each-value-once` (tests/conftest.py): of each parametrized test, a greedy cover in which every value of every
parameter runs at least once; worked by hand on small products. `--one-case-in FILE`: the first case of each
parametrized test in FILE."""
import itertools
import types

import pytest
from conftest import _each_value_once, _select_cases


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


def collected(node_ids: list[str]) -> list[types.SimpleNamespace]:
    """Stand-ins for collected items: `file::test[a-b]` has callspec.params {"p0": "a", "p1": "b"}; no brackets, none."""
    items = []
    for node_id in node_ids:
        values = node_id[:-1].split("[")[1].split("-") if "[" in node_id else None
        callspec = None if values is None else types.SimpleNamespace(params={f"p{i}": v for i, v in enumerate(values)})
        items.append(types.SimpleNamespace(nodeid=node_id, callspec=callspec))
    return items


def select(node_ids: list[str], one_case_in: list[str], each_value_once: bool) -> tuple[list[str], list[str]]:
    """The node ids `_select_cases` keeps, and those it reports deselected, under the two options."""
    options = {"--one-case-in": one_case_in, "--each-value-once": each_value_once}
    deselected: list[str] = []
    config = types.SimpleNamespace(
        getoption=options.__getitem__,
        hook=types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(i.nodeid for i in items)))
    items = collected(node_ids)
    _select_cases(config, items)
    return [item.nodeid for item in items], deselected


NODES = ["tests/test_a.py::test_x[1-u]", "tests/test_a.py::test_x[1-v]", "tests/test_a.py::test_x[2-u]",
         "tests/test_a.py::test_plain", "tests/test_b.py::Test::test_y[1-u]", "tests/test_b.py::Test::test_y[2-v]",
         "tests/test_b.py::Test::test_y[3-v]"]


def test_one_case_in_a_file_keeps_its_first_cases_and_the_cover_elsewhere():
    kept, deselected = select(NODES, ["tests/test_b.py"], each_value_once=True)
    # test_a's cover: [1-u] and [2-u] leave v, which [1-v] alone brings: all three stay; test_b: its first case only.
    assert kept == NODES[:5]
    assert sorted(deselected) == sorted(NODES[5:])


def test_one_case_in_without_the_cover_leaves_other_files_whole():
    kept, _ = select(NODES, ["tests/test_a.py"], each_value_once=False)
    assert kept == [NODES[0], NODES[3], *NODES[4:]]


def test_neither_option_keeps_every_case():
    assert select(NODES, [], each_value_once=False) == (NODES, [])


def test_a_file_with_no_collected_tests_is_refused():
    with pytest.raises(pytest.UsageError, match="tests/test_c.py"):
        select(NODES, ["tests/test_c.py"], each_value_once=True)
