"""Test durations: the record a pytest run writes, a report on it, and the committed table.

`make test` writes one record per run (build/test-times.json: each test's setup, call and teardown
seconds, its outcome and its xdist worker). This tool reports on a record:

    python tools/test_times.py                     # slowest 30 tests, each file's share
    python tools/test_times.py --top 50 --files 20 build/test-times.json
    python tools/test_times.py --update-table      # merge the record into tests/durations.json

tests/durations.json (committed; refreshed only by --update-table) holds each test's seconds
(total, setup). tests/conftest.py uses it twice through this module: test files run longest
first, so the two xdist workers (`--dist loadfile --no-loadscope-reorder`) end together; and
`--quick` (`make test-quick`) keeps only the tests of measured files that took at most
QUICK_LIMIT_S, no test sharing a fixture whose setup took longer, and within QUICK_BUDGET_S in
all. No test asserts on time.
"""

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "build" / "test-times.json"
TABLE = ROOT / "tests" / "durations.json"
# A test (or a shared fixture's setup) longer than this on the table's machine leaves the quick
# tier; and when the kept tests' recorded seconds add up to more than QUICK_BUDGET_S, the
# slowest of them leave too, so that the tier stays under 5 minutes on 2 cores (two workers,
# plus about 30 s of collection) however many tests are added.
QUICK_LIMIT_S = 2.0
QUICK_BUDGET_S = 400.0
PHASES = ("setup", "call", "teardown")


def file_of(nodeid):
    """The file part of a pytest node id ("tests/test_x.py::test_a[1]" -> "tests/test_x.py")."""
    return nodeid.split("::", 1)[0]


def load_record(path):
    """A run's record: {"tests": {nodeid: {"setup", "call", "teardown", "outcome", "worker",
    "end"}}, "wall_s", "started"}."""
    with open(path) as f:
        return json.load(f)


def load_table(path=TABLE):
    """The committed table {nodeid: (total_s, setup_s)}; empty when there is none."""
    try:
        with open(path) as f:
            tests = json.load(f)["tests"]
    except FileNotFoundError:
        return {}
    return {nodeid: (float(v[0]), float(v[1])) for nodeid, v in tests.items()}


def record_totals(record):
    """{nodeid: (total_s, setup_s)} of a record, in the table's form."""
    return {
        nodeid: (sum(t.get(p, 0.0) for p in PHASES), t.get("setup", 0.0))
        for nodeid, t in record["tests"].items()
    }


def merged_table(table, record, root=ROOT):
    """The table with a record's tests replacing or adding theirs; tests of files that no longer
    exist are dropped."""
    merged = dict(table)
    merged.update(record_totals(record))
    return {k: v for k, v in merged.items() if (Path(root) / file_of(k)).exists()}


def write_table(table, path=TABLE):
    """Writes the table one test a line, sorted, rounded to 10 ms (small diffs on refresh)."""
    lines = [
        f"{json.dumps(k)}: [{round(v[0], 2)}, {round(v[1], 2)}]" for k, v in sorted(table.items())
    ]
    with open(path, "w") as f:
        f.write('{"tests": {\n' + ",\n".join(lines) + "\n}}\n")


def file_totals(table):
    """{file: seconds} summed over the table's tests."""
    totals = defaultdict(float)
    for nodeid, (total, _) in table.items():
        totals[file_of(nodeid)] += total
    return dict(totals)


def longest_files_first(nodeids, table, slow=()):
    """Indices of nodeids reordered file by file: files missing from the table first (assumed
    long: a new file may start servers), those with more tests marked slow (nodeids in slow)
    before others, then the table's files by their total, longest first; tests keep their order
    inside a file and files of equal rank keep collection order."""
    totals = file_totals(table)
    first_seen = {}
    for i, nodeid in enumerate(nodeids):
        first_seen.setdefault(file_of(nodeid), i)
    slow_count = defaultdict(int)
    for nodeid in slow:
        slow_count[file_of(nodeid)] += 1

    def rank(f):
        if f not in totals:
            return (0, -slow_count[f], first_seen[f])
        return (1, -totals[f], first_seen[f])

    order = sorted(first_seen, key=rank)
    by_file = defaultdict(list)
    for i, nodeid in enumerate(nodeids):
        by_file[file_of(nodeid)].append(i)
    return [i for f in order for i in by_file[f]]


def quick_selection(tests, table, limit=QUICK_LIMIT_S, budget=QUICK_BUDGET_S):
    """Which tests the quick tier keeps: a list of booleans, one per test.

    tests: [(nodeid, shared)] in collection order, where shared lists keys of the test's
    fixtures that outlive one test (module/class/package scope: (file, fixture); session:
    (fixture,)). A test is dropped when its file is not in the table (measured on the next
    refresh), when its recorded total exceeds limit, or when it uses a shared fixture whose
    setup was slow: one first used by a test whose recorded setup exceeded limit (otherwise the
    next test to use it would pay that setup). A new test in a measured file is kept. Then the
    slowest kept tests are dropped until the kept ones add up to at most budget seconds.
    """
    known_files = {file_of(k) for k in table}
    heavy = set()
    first_user = {}
    for nodeid, shared in tests:
        for key in shared:
            first_user.setdefault(key, nodeid)
    for key, nodeid in first_user.items():
        if table.get(nodeid, (0.0, 0.0))[1] > limit:
            heavy.add(key)
    keep = []
    for nodeid, shared in tests:
        total = table.get(nodeid, (0.0, 0.0))[0]
        keep.append(
            file_of(nodeid) in known_files
            and total <= limit
            and not any(key in heavy for key in shared)
        )
    kept = [i for i, k in enumerate(keep) if k]
    summed = sum(table.get(tests[i][0], (0.0, 0.0))[0] for i in kept)
    for i in sorted(kept, key=lambda i: table.get(tests[i][0], (0.0, 0.0))[0], reverse=True):
        if summed <= budget:
            break
        keep[i] = False
        summed -= table.get(tests[i][0], (0.0, 0.0))[0]
    return keep


class Recorder:
    """pytest plugin (the controller's, under xdist): writes each test's phase durations, outcome
    and worker to a JSON record at the end of the session."""

    def __init__(self, path):
        self.path = Path(path)
        self.tests = {}
        self.start = time.time()

    def pytest_runtest_logreport(self, report):
        t = self.tests.setdefault(report.nodeid, {p: 0.0 for p in PHASES})
        t[report.when] = t.get(report.when, 0.0) + report.duration
        if report.when == "call" or report.outcome != "passed":
            t["outcome"] = report.outcome
        node = getattr(report, "node", None)
        t["worker"] = getattr(getattr(node, "gateway", None), "id", "main")
        t["end"] = round(time.time() - self.start, 3)

    def pytest_sessionfinish(self, session):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(
                {
                    "started": self.start,
                    "wall_s": round(time.time() - self.start, 3),
                    "args": list(session.config.invocation_params.args),
                    "tests": self.tests,
                },
                f,
                indent=0,
            )
        os.replace(tmp, self.path)


def _shared_fixture_keys(item):
    """Keys of an item's fixtures that outlive one test, defined by the project (not pytest's or
    a plugin's own)."""
    keys = []
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return keys
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if not defs:
            continue
        fixturedef = defs[-1]
        scope = str(fixturedef.scope)
        if scope == "function" or not fixturedef.baseid:
            continue
        if scope == "session":
            keys.append((fixturedef.baseid, name))
        else:
            keys.append((file_of(item.nodeid), fixturedef.baseid, name))
    return keys


def pytest_addoption(parser):
    """--times-record PATH and --quick (see the module docstring)."""
    group = parser.getgroup("test-times")
    group.addoption(
        "--times-record",
        metavar="PATH",
        default=None,
        help="write each test's setup/call/teardown seconds to PATH (tools/test_times.py)",
    )
    group.addoption(
        "--quick",
        action="store_true",
        default=False,
        help=f"keep only tests of measured files that took <= {QUICK_LIMIT_S} s "
        "(tests/durations.json)",
    )


def pytest_configure(config):
    """Registers the recorder on the controller (xdist workers send it their reports)."""
    path = config.getoption("times_record")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Recorder(path), "test-times-recorder")


def pytest_ignore_collect(collection_path, config):
    """--quick: test files missing from the table are not even imported (their tests would all
    be deselected; importing them costs the quick tier's collection most of its time)."""
    if not config.getoption("quick") or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    if not hasattr(config, "_test_times_known_files"):
        config._test_times_known_files = {file_of(k) for k in load_table()}
    try:
        rel = collection_path.resolve().relative_to(config.rootpath.resolve()).as_posix()
    except ValueError:
        return None
    return True if rel not in config._test_times_known_files else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Quick-tier deselection (--quick), then test files longest first (trylast: after -m and
    -k have deselected theirs)."""
    table = load_table()
    if config.getoption("quick"):
        keep = quick_selection([(i.nodeid, _shared_fixture_keys(i)) for i in items], table)
        dropped = [i for i, k in zip(items, keep) if not k]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [i for i, k in zip(items, keep) if k]
    slow = [i.nodeid for i in items if i.get_closest_marker("slow")]
    order = longest_files_first([i.nodeid for i in items], table, slow)
    items[:] = [items[i] for i in order]


def report(record, top=30, files=None, out=sys.stdout):
    """Prints a record's slowest tests and each file's share of the summed test time."""
    tests = record["tests"]
    totals = {k: sum(t.get(p, 0.0) for p in PHASES) for k, t in tests.items()}
    summed = sum(totals.values()) or 1e-9
    workers = defaultdict(lambda: [0.0, 0.0, 0])
    for k, t in tests.items():
        w = workers[t.get("worker", "main")]
        w[0] += totals[k]
        w[1] = max(w[1], t.get("end", 0.0))
        w[2] += 1
    print(
        f"{len(tests)} tests, {summed:.1f} s of test time, {record.get('wall_s', 0):.1f} s "
        f"wall; args: {' '.join(record.get('args', []))}",
        file=out,
    )
    for name, (busy, end, n) in sorted(workers.items()):
        print(
            f"  worker {name}: {n} tests, {busy:.1f} s busy, last test ended at {end:.1f} s",
            file=out,
        )
    print(f"\nslowest {top} tests (setup + call + teardown):", file=out)
    print(f"{'total s':>8} {'setup':>7} {'call':>7} {'tdown':>7}  test", file=out)
    for k in sorted(totals, key=totals.get, reverse=True)[:top]:
        t = tests[k]
        print(
            f"{totals[k]:8.1f} {t.get('setup', 0):7.1f} {t.get('call', 0):7.1f} "
            f"{t.get('teardown', 0):7.1f}  {k}",
            file=out,
        )
    per_file = defaultdict(lambda: [0.0, 0])
    for k, s in totals.items():
        per_file[file_of(k)][0] += s
        per_file[file_of(k)][1] += 1
    ranked = sorted(per_file.items(), key=lambda kv: kv[1][0], reverse=True)
    print(f"\neach file's share ({len(ranked)} files):", file=out)
    print(f"{'total s':>8} {'share':>6} {'tests':>5}  file", file=out)
    for f, (s, n) in ranked[:files]:
        print(f"{s:8.1f} {100 * s / summed:5.1f}% {n:5d}  {f}", file=out)


def main(argv=None):
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", nargs="?", default=str(RECORD), help="default: %(default)s")
    ap.add_argument("--top", type=int, default=30, help="slowest tests to list (default 30)")
    ap.add_argument("--files", type=int, default=None, help="files to list (default: all)")
    ap.add_argument(
        "--update-table",
        nargs="?",
        const=str(TABLE),
        default=None,
        metavar="PATH",
        help="merge the record into the duration table (default: %(const)s)",
    )
    args = ap.parse_args(argv)
    try:
        record = load_record(args.record)
    except FileNotFoundError:
        sys.exit(f"no record at {args.record}: run `make test` (it writes one) first")
    report(record, top=args.top, files=args.files)
    if args.update_table:
        table = merged_table(load_table(args.update_table), record)
        write_table(table, args.update_table)
        print(f"\n{args.update_table}: {len(table)} tests", file=sys.stderr)


if __name__ == "__main__":
    main()
