"""Package layering, checked on the source (AST), imports inside functions counted.

- No import cycle between files, and none between packages.
- A package imports only packages of its own layer or below (:data:`LAYERS`, the order
  ``docs/design.md`` states under "Package map").
- An import inside a function is kept only where the imported module pulls in a heavy
  dependency (:data:`HEAVY`) at import time; everything else is imported at the top.
- ``run_dir`` and the pure planners are imported by every process and must not import torch.
- Only ``rollout/client.py`` touches the client's private members; ``train/`` takes the
  weight-update group from ``parallel/``, not from the launcher.
- A file holds one concept; no file reaches 800 lines, a smoke alarm rather than a cap.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "areal_mega"
ROOT = PKG.parent

# Lowest first. A top-level module (trainer.py, run_dir.py, ...) is a package of its own; a dotted
# entry (``rollout.worker``) is a module or subpackage that sits in a higher layer than the rest
# of its package: the rollout worker process puts the rollout client, the workflows and
# evaluation together, so it sits above all three.
LAYERS = [
    ["common"],
    ["compat", "security"],
    ["parallel", "data", "dataplane", "models", "run_dir", "rewards", "tracking"],
    ["checkpoint", "config", "lora", "scheduler", "ops"],
    ["algo", "engine"],
    ["inference"],
    ["rollout"],
    ["backends"],
    ["workflow"],
    ["eval"],
    ["rollout.worker", "train"],
    ["trainer", "launch", "demo", "doctor"],
]
SUBPACKAGE_LAYERS = [p for layer in LAYERS for p in layer if "." in p]
# Importing one of these costs seconds or needs an optional extra: a module that pulls one in
# at import time may be imported inside a function.
HEAVY = {
    "torch",
    "megatron",
    "transformer_engine",
    "transformers",
    "tokenizers",
    "sglang",
    "openai",
    "datasets",
    "apex",
    "matplotlib",
    "tensorboard",
    "math_verify",
    "pyarrow",
    "peft",
    "wandb",
    "mlflow",
    "safetensors",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=None)
def _modules() -> dict:
    return {_module_name(f): f for f in sorted(PKG.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    mods = _modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _in_type_checking(node, parents) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


@lru_cache(maxsize=None)
def _imports(module: str) -> tuple:
    """``(target, inside_function, external_top_name, lineno)`` for each import of ``module``;
    ``target`` is the internal module it loads (None for an external one)."""
    path = _modules()[module]
    tree = ast.parse(path.read_text())
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in _modules() else base for a in node.names
            ]
        else:
            continue
        if _in_type_checking(node, parents):
            continue
        inside, p = False, node
        while p in parents:
            p = parents[p]
            if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inside = True
        for name in names:
            if name.split(".")[0] == "areal_mega":
                target = _resolve(name)
                if target and target != module:
                    out.append((target, inside, None, node.lineno))
            else:
                out.append((None, inside, name.split(".")[0], node.lineno))
    return tuple(out)


def _package(module: str) -> str:
    """The layer entry of ``module``: its top-level package, or the dotted entry of
    :data:`LAYERS` it lies in (``areal_mega.rollout.worker`` -> ``rollout.worker``)."""
    parts = module.split(".")
    if len(parts) < 2:
        return parts[0]
    for entry in SUBPACKAGE_LAYERS:
        n = entry.count(".") + 1
        if parts[1 : 1 + n] == entry.split("."):
            return entry
    return parts[1]


def _edges() -> dict:
    edges = {m: set() for m in _modules()}
    for m in _modules():
        edges[m] |= {t for t, *_ in _imports(m) if t}
    return edges


def _cycles(edges: dict) -> list:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


@lru_cache(maxsize=None)
def _heavy(module: str) -> bool:
    """True when importing ``module`` imports a :data:`HEAVY` package (module level,
    transitively, the enclosing packages' ``__init__`` included)."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parent = m.rpartition(".")[0]
        if parent in _modules():
            todo.append(parent)
        for target, inside, ext, _ in _imports(m):
            if inside:
                continue
            if ext in HEAVY:
                return True
            if target:
                todo.append(target)
    return False


def test_the_graph_sees_imports_inside_functions():
    """The checks below are only as good as the parser: a known import inside a function and
    a known relative import are found."""
    sup = _imports("areal_mega.train.session")
    assert any(t == "areal_mega.engine.megatron_engine" and inside for t, inside, *_ in sup)
    ops = _imports("areal_mega.ops")
    assert any(t == "areal_mega.ops.logprob" for t, *_ in ops)
    assert _heavy("areal_mega.engine.megatron_engine") and not _heavy("areal_mega.run_dir")
    assert _package("areal_mega.rollout.worker") == "rollout.worker"
    assert _package("areal_mega.rollout.client") == "rollout"
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_files():
    assert _cycles(_edges()) == []


def test_no_import_cycle_between_packages():
    pk = {}
    for m, targets in _edges().items():
        pk.setdefault(_package(m), set()).update(_package(t) for t in targets)
    for p, targets in pk.items():
        targets.discard(p)
    assert _cycles(pk) == []


def test_every_package_has_a_layer_and_imports_only_its_layer_or_below():
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    packages = {_package(m) for m in _modules()} - {"areal_mega"}
    assert packages <= set(rank), f"packages without a layer: {sorted(packages - set(rank))}"
    bad = sorted(
        f"{m}:{line} imports {t} ({_package(m)} is below {_package(t)})"
        for m in _modules()
        for t, _, _, line in _imports(m)
        if t
        and _package(t) in rank
        and _package(m) in rank
        and rank[_package(t)] > rank[_package(m)]
    )
    assert not bad, "\n".join(bad)


def test_imports_inside_functions_are_only_for_heavy_dependencies():
    bad = sorted(
        f"{m}:{line} imports {t} inside a function, but {t} is light"
        for m in _modules()
        for t, inside, _, line in _imports(m)
        if t and inside and not _heavy(t)
    )
    assert not bad, "\n".join(bad)


def test_the_inference_server_imports_nothing_from_the_client_side():
    bad = sorted(
        f"{m} imports {t}"
        for m in _modules()
        if _package(m) == "inference"
        for t, *_ in _imports(m)
        if t
        and _package(t)
        in (
            "rollout",
            "backends",
            "workflow",
            "train",
            "launch",
            "eval",
            "rollout.worker",
            "trainer",
        )
    )
    assert not bad, bad


@pytest.mark.parametrize(
    "layer",
    ["rollout", "rollout.worker", "backends", "dataplane", "inference", "workflow", "rewards"],
)
def test_rollout_side_imports_nothing_from_the_trainer(layer):
    files = [m for m in _modules() if _package(m) == layer]
    assert files
    bad = {
        f"{m}: {t}"
        for m in files
        for t, *_ in _imports(m)
        if t and _package(t) in ("train", "trainer")
    }
    assert not bad, sorted(bad)


@pytest.mark.parametrize(
    "module",
    [
        "run_dir",
        "parallel.allocation",
        "scheduler.planner",
        "launch.plan",
        "rollout.staleness",
        "common.files",
        "common.net",
        "common.loading",
    ],
)
def test_pure_modules_do_not_import_torch(module):
    found = {ext for _, _, ext, _ in _imports(f"areal_mega.{module}") if ext}
    assert "torch" not in found, found


def test_the_weight_group_loads_torch_only_to_form_the_group():
    """The launcher takes the group's shape from ``parallel.weight_group``: torch is imported
    only inside the functions that form the process group."""
    imports = _imports("areal_mega.parallel.weight_group")
    assert any(ext == "torch" for _, _, ext, _ in imports)
    assert not _heavy("areal_mega.parallel.weight_group")


def test_the_rollout_package_stays_small():
    """The client side (13 files) and the worker process (``rollout/worker.py``)."""
    assert len(list((PKG / "rollout").glob("*.py"))) <= 15


def test_one_place_replaces_files_and_one_picks_free_ports():
    replacing = sorted(
        str(f.relative_to(PKG)) for f in PKG.rglob("*.py") if "os.replace(" in f.read_text()
    )
    assert len(replacing) <= 2, replacing
    port_helpers = sorted(
        f"{f.relative_to(PKG)}: {n.name}"
        for f in PKG.rglob("*.py")
        for n in ast.walk(ast.parse(f.read_text()))
        if isinstance(n, ast.FunctionDef) and "free_port" in n.name
    )
    assert [h.split(":")[0] for h in port_helpers] == ["common/net.py"] * len(port_helpers), (
        port_helpers
    )


def test_the_one_step_walk_in_the_design_doc_names_at_most_20_real_files():
    doc = (PKG.parent / "docs" / "design.md").read_text()
    walk = doc.split("## One RL step, file by file", 1)[1].split("\n## ", 1)[0]
    steps = [line for line in walk.splitlines() if line[:1].isdigit() and ". `" in line]
    files = [line.split("`")[1] for line in steps]
    assert 10 <= len(files) <= 20, files
    missing = [f for f in files if not (PKG / f).is_file()]
    assert not missing, missing


def test_the_trainer_imports_nothing_from_the_launcher():
    bad = sorted(
        f"{m}: {t}"
        for m in _modules()
        if _package(m) == "train"
        for t, *_ in _imports(m)
        if t and _package(t) == "launch"
    )
    assert not bad, bad


def test_only_the_client_touches_its_private_members():
    """Relaunch tolerance, elastic membership and the weight sender use the client's public
    methods and hooks (:mod:`areal_mega.rollout.hooks`), never its internals."""
    private = re.compile(
        r"\._(pick|call|check_one|broadcast|sticky|servers|find|mark_down)\b"
        r"|\b_Server\b"
    )
    bad = [
        f"{f.relative_to(PKG)}:{i}: {line.strip()}"
        for f in sorted(PKG.rglob("*.py"))
        if f != PKG / "rollout" / "client.py"
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not bad, bad


def test_no_source_file_sets_off_the_800_line_smoke_alarm():
    """A file holds one concept and is named after it. When it holds two, it is split into a
    subpackage named by role (``config/``: schema, sections, checks), never into pieces cut to
    fit a line count. Length is not the rule: 800 lines is a smoke alarm only, and a file that
    sets it off is read for the second concept it may hold."""
    roots = ["areal_mega", "tests", "tools", "launch", "bench", "examples"]
    files = [p for r in roots for p in (ROOT / r).rglob("*.py")]
    assert len(files) > 100
    long = {
        str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 800
    }
    assert not long, long
