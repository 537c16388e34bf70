#!/usr/bin/env python3
"""Import cycles between the modules of one crate, from its `use crate::...` / `super::` lines.

    scripts/module-cycles.py crates/rdmakit-verbs/src

Each .rs file is a module (`foo.rs` and `foo/mod.rs` are `foo`, `foo/bar.rs` is `foo::bar`).
An edge a -> b means a file of module a names module b (or an item in it) in a `use` line or a
path (`crate::b::...`, `super::b` resolved). Prints every strongly connected component with more
than one module: a cycle, which a reader must take in as a whole. Exit 0 either way; the output
is the report. It reads text, so a path built by a macro is not seen.
"""
import os
import re
import sys


def module_of(root, path):
    rel = os.path.relpath(path, root)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return "::".join(rel)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "src"
    mods = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".rs"):
                p = os.path.join(d, f)
                mods[module_of(root, p)] = p
    names = set(mods)
    edges = {m: set() for m in names}
    for m, p in mods.items():
        text = open(p, encoding="utf-8").read()
        # Drop comments so doc links and prose do not count.
        text = re.sub(r"//[^\n]*", "", text)
        parent = m.rsplit("::", 1)[0] if "::" in m else ""
        # `mod.rs` / `lib.rs` files are their module; `super` of them is one level up.
        is_dir_module = os.path.basename(p) in ("mod.rs", "lib.rs")
        sup = m if False else (m.rsplit("::", 1)[0] if "::" in m else "")
        if is_dir_module:
            sup = parent
        for path in re.findall(r"\b(crate|super|self)((?:::\w+)+)", text):
            base, rest = path
            parts = [x for x in rest.split("::") if x]
            if base == "crate":
                prefix = []
            elif base == "super":
                prefix = sup.split("::") if sup else []
            else:
                prefix = m.split("::") if m else []
            full = prefix + parts
            # The longest prefix that is a module of the crate.
            for k in range(len(full), 0, -1):
                cand = "::".join(full[:k])
                if cand in names:
                    if cand != m and not m.startswith(cand + "::") and not cand.startswith(m + "::"):
                        edges[m].add(cand)
                    break
    # Tarjan's strongly connected components.
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(names):
        if v not in index:
            strong(v)
    cycles = [sorted(c) for c in comps if len(c) > 1]
    print(f"{root}: {len(names)} modules, {sum(len(e) for e in edges.values())} edges, "
          f"{len(cycles)} cycle(s)")
    for c in sorted(cycles, key=len, reverse=True):
        print(f"  {len(c)} modules: {', '.join(c)}")


if __name__ == "__main__":
    main()
