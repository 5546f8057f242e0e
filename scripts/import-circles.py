#!/usr/bin/env python3
"""Import circles between modules, per crate: exits 1 and names them if any.

Module `a` imports `b` when its code (comments and `#[cfg(test)]` onward left
out) names a path through `b` (`crate::x::y`, `super::y`, `self::y`, or a
child module `y::`). A parent and its descendants may name each other (a
`mod.rs` re-exports its children, a child uses its parent's types); any other
import is counted between the two siblings that hold its ends, under their
lowest common module, and a circle among siblings is reported with the
imports that make it."""
import pathlib, re, sys

CRATES = ["zero-core", "zero-nccl", "zero-mpi-gloo", "zero-candle", "examples"]
PATH = re.compile(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")
BARE = re.compile(r"(?<![A-Za-z0-9_:])([a-z_][a-z0-9_]*)::[A-Za-z_{]")


def module_of(src, f):
    parts = list(f.relative_to(src).with_suffix("").parts)
    return tuple(parts[:-1] if parts[-1] in ("mod", "lib", "main") else parts)


def imports(src):
    files = {module_of(src, f): f for f in src.rglob("*.rs")}
    mods = set(files)

    def resolve(path):
        for k in range(len(path), -1, -1):
            if tuple(path[:k]) in mods:
                return tuple(path[:k])
        return ()

    edges = {m: set() for m in mods}
    for m, f in files.items():
        text = re.sub(r"//[^\n]*", "", f.read_text().split("#[cfg(test)]")[0])
        for found in PATH.finditer(text):
            segs = found.group(1).split("::")
            if segs[0] == "crate":
                path = segs[1:]
            elif segs[0] == "self":
                path = list(m) + segs[1:]
            else:
                base = list(m)
                while segs and segs[0] == "super":
                    base, segs = base[:-1], segs[1:]
                path = base + segs
            edges[m].add(resolve(path))
        children = {x[-1] for x in mods if len(x) == len(m) + 1 and x[: len(m)] == m}
        for found in BARE.finditer(text):
            if found.group(1) in children:
                edges[m].add(m + (found.group(1),))
    return mods, edges


def sibling_graph(mods, edges):
    graph, why = {m: set() for m in mods}, {}
    for a, targets in edges.items():
        for b in targets:
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            if k in (len(a), len(b)):
                continue  # one holds the other
            x, y = a[: k + 1], b[: k + 1]
            graph[x].add(y)
            why.setdefault((x, y), set()).add(f"{'/'.join(a)} -> {'/'.join(b)}")
    return graph, why


def circles(graph):
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


root = pathlib.Path(__file__).resolve().parent.parent
failed = False
for crate in CRATES:
    src = root / crate / "src"
    if not src.exists():
        continue
    graph, why = sibling_graph(*imports(src))
    for circle in circles(graph):
        failed = True
        print(f"{crate}: an import circle among {', '.join('/'.join(m) for m in circle)}")
        for x in circle:
            for y in sorted(graph[x]):
                if y in circle:
                    print(f"    {'; '.join(sorted(why[(x, y)])[:4])}")
if failed:
    sys.exit(1)
print("no import circles")
