"""The layout drawn in docs/architecture.md is the code's: every import between rooms
(function-level ones too) is an arrow listed there, there are no import circles, and
the pure rooms load no Celery."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedq"


def _room(module: str) -> str:
    parts = module.split(".")
    return "fedq" if len(parts) == 1 else parts[1]


def _imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, its room) for every fedq import in fedq/."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            found += [(module, n, _room(n)) for n in names if n.split(".")[0] == "fedq"]
    return found


def _arrows() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```arrows\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```arrows block"
    arrows: dict[str, set[str]] = {}
    for line in block.group(1).strip().splitlines():
        src, _, dsts = line.partition(" -> ")
        arrows[src.strip()] = {d.strip() for d in dsts.split(",")}
    return arrows


def test_every_import_between_rooms_is_a_drawn_arrow() -> None:
    arrows = _arrows()
    wrong = sorted({f"{mod} imports {target}" for mod, target, room in _imports()
                    if room != _room(mod) and room not in arrows.get(_room(mod), set())})
    assert not wrong, "imports the diagram does not draw:\n" + "\n".join(wrong)


def test_every_drawn_arrow_exists() -> None:
    used = {(_room(mod), room) for mod, _, room in _imports() if room != _room(mod)}
    drawn = {(src, dst) for src, dsts in _arrows().items() for dst in dsts}
    assert drawn - used == set(), "arrows in the diagram with no import behind them"


def test_no_import_circles_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in PACKAGE.rglob("*.py")}
    for mod, target, _ in _imports():
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]  # `from fedq.x import name`
        if target in modules and not (PACKAGE.parent / (target.replace(".", "/"))).is_dir():
            graph.setdefault(mod, set()).add(target)
    seen: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for nxt in graph.get(node, ()):
            assert seen.get(nxt) != 1, " -> ".join([*stack[stack.index(nxt):], nxt])
            if nxt not in seen:
                visit(nxt, [*stack, nxt])
        seen[node] = 2

    for start in sorted(graph):
        if start not in seen:
            visit(start, [start])


def test_pure_rooms_load_no_celery() -> None:
    code = ("import sys, fedq.aggregate, fedq.aggregate.reducers, fedq.aggregate.server, "
            "fedq.spec, fedq.protocol.training, fedq.protocol.inference, fedq.weights; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == "[]"


def test_the_clis_read_only_commands_load_no_torch() -> None:
    """fedq results, watch, status, cancel, resume, report and plot import these and
    never need torch (importing it costs about 1.7 s of CPU a command) or numpy (0.26 s:
    only a client split and a round plan use it, and import it there)."""
    code = ("import sys, fedq.cli.commands, fedq.cli.observe, fedq.cli.output, "
            "fedq.coordinator.jobs, fedq.inference.jobs, fedq.process; "
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == "False False"


def test_every_task_name_the_app_sends_is_registered() -> None:
    """Routes and the beat schedule name tasks by string; each must be a task a worker
    registers (a renamed task would be dropped as 'unregistered' by every worker)."""
    code = ("import fedq, fedq.tasks.train, fedq.tasks.control; from fedq.engine import names; "
            "app = fedq.app; app.loader.import_default_modules(); "
            "sent = {v for k, v in vars(names).items() if k.endswith('_TASK')}; "
            "sent |= {e['task'] for e in app.conf.beat_schedule.values()}; "
            "sent |= {n for n in app.conf.task_routes if n.startswith('fedq.')}; "
            "print(sorted(sent - set(app.tasks)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120, cwd=ROOT).stdout.strip()
    assert out == "[]"
