"""tools/test_times.py: file ordering, quick-tier selection, the record and its report."""

import io
import json

from tools import test_times as tt


def test_files_run_longest_first_and_unknown_files_first():
    table = {
        "tests/test_a.py::x": (1.0, 0.0),
        "tests/test_b.py::y": (30.0, 0.0),
        "tests/test_b.py::z": (5.0, 0.0),
        "tests/test_c.py::w": (10.0, 0.0),
    }
    nodeids = [
        "tests/test_a.py::x",
        "tests/test_b.py::y",
        "tests/test_b.py::z",
        "tests/test_new.py::n1",
        "tests/test_c.py::w",
        "tests/test_new.py::n2",
    ]
    order = [nodeids[i] for i in tt.longest_files_first(nodeids, table)]
    assert order == [
        "tests/test_new.py::n1",
        "tests/test_new.py::n2",
        "tests/test_b.py::y",
        "tests/test_b.py::z",
        "tests/test_c.py::w",
        "tests/test_a.py::x",
    ]


def test_unknown_files_with_more_slow_tests_go_first():
    table = {"tests/test_a.py::x": (1.0, 0.0)}
    nodeids = [
        "tests/test_a.py::x",
        "tests/test_b.py::y",
        "tests/test_c.py::w1",
        "tests/test_c.py::w2",
        "tests/test_d.py::v",
    ]
    slow = [
        "tests/test_c.py::w1",
        "tests/test_c.py::w2",
        "tests/test_d.py::v",
        "tests/test_a.py::x",
    ]
    order = [nodeids[i] for i in tt.longest_files_first(nodeids, table, slow)]
    assert order == [
        "tests/test_c.py::w1",
        "tests/test_c.py::w2",
        "tests/test_d.py::v",
        "tests/test_b.py::y",
        "tests/test_a.py::x",
    ]


def test_file_order_keeps_collection_order_without_a_table():
    nodeids = ["tests/test_b.py::y", "tests/test_a.py::x", "tests/test_b.py::z"]
    assert tt.longest_files_first(nodeids, {}) == [0, 2, 1]


def test_quick_drops_slow_tests_unmeasured_files_and_users_of_a_slow_shared_fixture():
    table = {
        "tests/test_u.py::fast": (0.1, 0.0),
        "tests/test_u.py::slow": (9.0, 0.0),
        "tests/test_m.py::first": (30.0, 29.0),
        "tests/test_m.py::second": (0.2, 0.0),
        "tests/test_m.py::own": (0.2, 0.0),
    }
    model = ("tests/test_m.py", "tests", "model")
    tests = [
        ("tests/test_u.py::fast", []),
        ("tests/test_u.py::slow", []),
        ("tests/test_u.py::added_since", []),
        ("tests/test_new.py::t", []),
        ("tests/test_m.py::first", [model]),
        ("tests/test_m.py::second", [model]),
        ("tests/test_m.py::own", []),
    ]
    assert tt.quick_selection(tests, table, limit=2.0) == [
        True,
        False,
        True,
        False,
        False,
        False,
        True,
    ]


def test_quick_keeps_users_of_a_shared_fixture_whose_setup_was_fast():
    table = {"tests/test_m.py::first": (3.0, 0.1), "tests/test_m.py::second": (0.2, 0.0)}
    shared = [("tests/test_m.py", "tests", "server")]
    tests = [("tests/test_m.py::first", shared), ("tests/test_m.py::second", shared)]
    assert tt.quick_selection(tests, table, limit=2.0) == [False, True]


def test_quick_drops_its_slowest_tests_to_stay_within_the_budget():
    table = {f"tests/test_u.py::t{i}": (float(i), 0.0) for i in range(6)}
    tests = [(k, []) for k in table] + [("tests/test_u.py::new", [])]
    keep = tt.quick_selection(tests, table, limit=10.0, budget=6.5)
    assert keep == [True, True, True, True, False, False, True]
    assert tt.quick_selection(tests, table, limit=10.0, budget=100.0) == [True] * 7


def test_record_report_and_table_round_trip(tmp_path):
    record = {
        "wall_s": 12.0,
        "args": ["-n", "2"],
        "tests": {
            "tests/test_a.py::x": {
                "setup": 1.0,
                "call": 2.0,
                "teardown": 0.5,
                "outcome": "passed",
                "worker": "gw0",
                "end": 3.5,
            },
            "tests/test_b.py::y": {
                "setup": 0.0,
                "call": 6.5,
                "teardown": 0.0,
                "outcome": "passed",
                "worker": "gw1",
                "end": 6.5,
            },
        },
    }
    out = io.StringIO()
    tt.report(record, top=1, out=out)
    text = out.getvalue()
    assert "2 tests, 10.0 s of test time, 12.0 s wall" in text
    assert "worker gw0: 1 tests, 3.5 s busy" in text
    assert "     6.5     0.0     6.5     0.0  tests/test_b.py::y" in text
    assert "tests/test_a.py::x" not in text.split("each file's share")[0]
    assert "     6.5  65.0%     1  tests/test_b.py" in text
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("")
    table = tt.merged_table({"tests/test_gone.py::z": (1.0, 0.0)}, record, root=tmp_path)
    assert table == {"tests/test_a.py::x": (3.5, 1.0)}
    path = tmp_path / "durations.json"
    tt.write_table(table, path)
    assert json.loads(path.read_text()) == {"tests": {"tests/test_a.py::x": [3.5, 1.0]}}
    assert tt.load_table(path) == table
