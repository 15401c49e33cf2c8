"""Parsing a GGUF's metadata: gguf-py's GGUFReader vs voodoo.ggufio.read_gguf, same file,
same run; prints the wall times and their ratio.

    python benchmarks/gguf_read.py [FILE.gguf] [--repeat 3]

Default file: the default model's GGUF (SmolLM2-135M-Instruct Q4_1, a 49k-token vocabulary).
"""
import argparse
import time

from gguf import GGUFReader

from voodoo.ggufio import read_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="?")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if a.gguf is None:
        from voodoo.models import default_model
        a.gguf = str(default_model())
    best = {}
    for _ in range(a.repeat):
        for name, fn in (("gguf.GGUFReader", GGUFReader), ("voodoo read_gguf", read_gguf)):
            t0 = time.perf_counter()
            r = fn(a.gguf)
            best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
    n = len(r.fields)
    for k, v in best.items():
        print(f"{k:18s} {v:6.2f} s  ({n} fields, {len(r.tensors)} tensors; best of {a.repeat})")
    print(f"ratio: read_gguf is {best['gguf.GGUFReader'] / best['voodoo read_gguf']:.1f}x faster")


if __name__ == "__main__":
    main()
