"""The house shows its plan (issue 32): a table of layers, checked on the
package's imports with ``ast``.

- no import runs upward: a folder imports only folders below it in LAYERS
  (inside engine/, below it in ENGINE_LAYERS), so there is no circle between
  folders; imports under ``if TYPE_CHECKING:`` are type hints and do not count;
- no private name (``_x``) is imported from another file;
- every ``[Note: X] in FILE`` names a file that holds the Note, and every Note
  referred to is written somewhere;
- every package folder has an ``__init__`` docstring saying what it owns and
  what it may import.
"""

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "infinity"

# Higher imports lower; equal ranks may not import each other. ``api`` is the
# public door (api.py); ``infinity`` is the package's __init__, which may
# import anything.
LAYERS = {
    "__main__": 10, "cli": 9, "integrations": 8, "stress": 8, "checkpoint": 7, "progress": 7, "api": 6, "engine": 5,
    "optim": 4, "io": 3, "lazy_init": 2, "system": 2, "config": 1, "models": 1,
}
ENGINE_LAYERS = {
    "model": 6, "core": 5, "step": 4, "adapt": 3, "values": 3, "owners": 2, "mechanism": 1,
    "plan": 0, "faults": 0, "stats": 0, "fence": 0, "parts": 0,
}


def modules():
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        yield f, ".".join(parts[:-1] if is_pkg else parts), is_pkg


def runtime_imports(tree):
    """(node, absolute-or-relative ImportFrom/Import) outside ``if TYPE_CHECKING``."""
    skip = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            skip.update(id(x) for b in n.body for x in ast.walk(b))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def targets(node, mod, is_pkg):
    """Absolute module names an import statement loads (a name imported from a
    package counts as its submodule when one exists)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if node.level:
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = []
    for a in node.names:
        sub = PKG.parent / (target + "." + a.name).replace(".", "/")
        out.append(target + "." + a.name if sub.with_suffix(".py").exists() or sub.is_dir() else target)
    return out


def layer(mod):
    """(folder key, rank) of an infinity module, or None outside the package."""
    parts = mod.split(".")
    if parts[0] != "infinity":
        return None
    if len(parts) == 1:
        return ("infinity", None)
    top = parts[1]
    if top == "engine" and len(parts) > 2:
        return ("engine." + parts[2], ENGINE_LAYERS[parts[2]])
    return (top, LAYERS[top])


def test_every_folder_is_in_the_table():
    for f, mod, _ in modules():
        parts = mod.split(".")
        if len(parts) > 1:
            assert parts[1] in LAYERS, f"{f}: folder or module {parts[1]!r} is missing from LAYERS"
        if len(parts) > 2 and parts[1] == "engine":
            assert parts[2] in ENGINE_LAYERS, f"{f}: {parts[2]!r} is missing from ENGINE_LAYERS"


def test_no_import_runs_upward():
    offenders = []
    for f, mod, is_pkg in modules():
        me = layer(mod)
        if me[1] is None:
            continue
        for node in runtime_imports(ast.parse(f.read_text())):
            for t in targets(node, mod, is_pkg):
                other = layer(t)
                if other is None or other[0] == me[0]:
                    continue
                if other[1] is None:
                    if me[0] not in ("cli", "__main__", "integrations", "stress"):
                        offenders.append(f"{f.relative_to(PKG.parent)}:{node.lineno}: imports the package root")
                    continue
                mine, theirs = me[0].split(".")[0], other[0].split(".")[0]
                upward = other[1] >= me[1] if mine == theirs == "engine" else LAYERS[theirs] >= LAYERS[mine]
                if upward:
                    offenders.append(f"{f.relative_to(PKG.parent)}:{node.lineno}: {me[0]} imports {t} ({other[0]})")
    assert not offenders, "\n".join(offenders)


def test_no_private_name_crosses_files():
    offenders = []
    for f, mod, is_pkg in modules():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("infinity")):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        offenders.append(f"{f.relative_to(PKG.parent)}:{node.lineno}: {a.name}")
    assert not offenders, offenders


NOTE = re.compile(r"\[Note: ([^\]]+)\]")
NOTE_IN = re.compile(r"\[Note: ([^\]]+)\]\)? in ([\w/]+\.py)")


def flat(text):
    """Text with comment and docstring line breaks folded, so a Note name that wraps reads whole."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


def test_note_references_name_the_file_that_holds_the_note():
    texts = {f: flat(f.read_text()) for f in PKG.rglob("*.py")}
    written = set()
    for text in texts.values():
        written.update(m.group(1) for m in NOTE.finditer(text) if not text[max(0, m.start() - 12):m.start()]
                       .rstrip().lower().endswith(("see", "(see", "in", "and")))
    bad = []
    for f, text in texts.items():
        for m in NOTE.finditer(text):
            if m.group(1) not in written:
                bad.append(f"{f.name}: [Note: {m.group(1)}] is written nowhere")
        for m in NOTE_IN.finditer(text):
            note, name = m.groups()
            homes = [g for g in texts if str(g).endswith("/" + name)]
            if not any(f"[Note: {note}]" in texts[g] for g in homes):
                bad.append(f"{f.relative_to(PKG.parent)}: [Note: {note}] is not in {name}")
    assert not bad, bad


@pytest.mark.parametrize("folder", sorted({str(p.parent.relative_to(PKG.parent)) for p in PKG.rglob("*.py")}))
def test_every_folder_says_what_it_owns_and_may_import(folder):
    init = PKG.parent / folder / "__init__.py"
    assert init.exists(), f"{folder}/ has no __init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert len(doc) > 80, f"{init}: the docstring should say what the folder owns"
    assert re.search(r"may import", doc, re.I), f"{init}: the docstring should say what the folder may import"
