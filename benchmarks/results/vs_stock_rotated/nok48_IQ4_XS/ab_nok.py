"""vs_stock with the k-quant coordinate descent switched off (A/B control)."""
import runpy, sys
sys.path.insert(0, "/work/main")
import voodoo.rounding as R
import voodoo.candidates as C
R._refine_k = lambda w, data, name, hd, sweeps, scales=True: data
C._K_REFINED = frozenset()
sys.argv = ["benchmarks/vs_stock.py"] + sys.argv[1:]
runpy.run_path("/work/main/benchmarks/vs_stock.py", run_name="__main__")
