"""``seqify zoo``: list the zoo, or check that its models convert and pipeline exactly."""

from __future__ import annotations

import argparse

from seqify.tools.console import NOT_EXACT, OK

__all__ = ["zoo_cmd"]

def zoo_cmd(args: argparse.Namespace) -> int:
    from seqify import zoo

    names = args.names or zoo.list(args.family)
    for n in names:
        zoo.entry(n)  # unknown names fail here, with close matches
    if args.check:
        from seqify.zoo.check import check_all

        missing = [n for n in names if not zoo.entry(n).available]
        if missing and not args.names:  # checking the whole zoo: skip what needs an extra that is not installed
            print(f"skipped {', '.join(missing)}: they need transformers (pip install 'seqify[hf]')")
            names = [n for n in names if n not in missing]
        results = check_all(names)
        for c in results:
            mark = "ok  " if c.ok else "FAIL"
            print(f"{mark} {c.name:30s} {c.layers:5d} layers {c.skips:4d} skips  exact={c.exact} "
                  f"pipelined={c.pipelined}  {c.seconds:.1f} s")
        failed = [c for c in results if not c.ok]
        print(f"{len(results) - len(failed)} of {len(results)} zoo models convert and pipeline exactly "
              "(small configurations, eval mode, 2 CPU partitions)")
        return NOT_EXACT if failed else OK
    print(f"{'name':30s} {'family':14s} source")
    for n in names:
        e = zoo.entry(n)
        print(f"{n:30s} {e.family:14s} {e.source}")
    print(f"\n{len(names)} models: seqify.zoo.get(name) converts one; seqify.zoo.hints(name, gpus) gives its balance; "
          "docs/zoo.md has the table")
    return OK
