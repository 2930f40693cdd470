"""``docs/design.md`` §0, the map, stays true: no room of ``spmdmoe`` imports a room of a higher layer (every
import statement counts, also one inside a function), and every ``file:function`` entry of its tables
exists."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def _map_text() -> str:
    text = DESIGN.read_text()
    return text[text.index("## 0. Map"):text.index("## 1. ")]


def _layers() -> dict[str, int]:
    """Room -> layer, from the map's first table (a row may name several rooms)."""
    rooms = {}
    for line in _map_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for room in re.findall(r"`(spmdmoe[\w.]*)`", cells[1]):
                rooms[room] = int(cells[0])
    return rooms


def _room(module: str, rooms: dict[str, int]) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in rooms:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} belongs to no room of docs/design.md §0: add it to the map")


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, imported spmdmoe module) of every import statement in ``path``."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names] if node.module is None else [base]
            found += [(node.lineno, n) for n in names if n.startswith("spmdmoe")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("spmdmoe")]
    return found


def test_no_room_imports_a_higher_layer():
    rooms = _layers()
    assert {"spmdmoe", "spmdmoe.types", "spmdmoe.agreement", "spmdmoe.moe"} <= set(rooms), rooms
    upward = []
    for path in sorted((ROOT / "spmdmoe").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mine = _room(module, rooms)
        for line, target in _imports(path):
            theirs = _room(target, rooms)
            if theirs != mine and rooms[theirs] >= rooms[mine]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {mine} (layer {rooms[mine]}) imports {target} "
                              f"(layer {rooms[theirs]})")
    assert not upward, "imports against docs/design.md §0:\n" + "\n".join(upward)


def test_every_map_entry_exists():
    entries = re.findall(r"`((?:spmdmoe|tests)/[\w/]+\.py):([\w.]+)`", _map_text())
    assert len(entries) >= 12, entries
    for file, qualname in entries:
        module = importlib.import_module(file.removesuffix(".py").replace("/", ".")) if file.startswith("spmdmoe") \
            else None
        if module is None:  # a test: its function is defined in that file
            assert re.search(rf"^def {qualname}\(", (ROOT / file).read_text(), re.M), f"{file}:{qualname}"
            continue
        obj = module
        for part in qualname.split("."):
            obj = getattr(obj, part)  # AttributeError names what moved
        assert callable(obj), f"{file}:{qualname}"
