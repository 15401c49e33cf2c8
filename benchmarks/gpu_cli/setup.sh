# Sourced by run.sh and ray_exit.sh on the GPU machine (repo root; .device and .gpu carried):
# the staged Ray wheels, a private VOODOO_CACHE holding the staged llama.cpp source, cython_ggml
# and libggml-base built there, and the pipeline's llama.cpp tools unless LIBONLY is set.
# Sets O (the output folder, $OUT or /tmp/out) and t0.
O=${OUT:-/tmp/out}; mkdir -p $O
[ -f .device/setup.sh ] && source .device/setup.sh
export VOODOO_CACHE=${VOODOO_CACHE:-/tmp/vc} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
S=$VOODOO_CACHE/llama.cpp/0c1e57098
if [ ! -f $S/src/convert_hf_to_gguf.py ]; then mkdir -p $S && tar xJf .gpu/llama-src.tar.xz -C $S; fi
t0=$(date +%s)
ls cython_ggml/_ggml*.so 2>/dev/null | grep -q "$(python3 -c 'import sysconfig;print(sysconfig.get_config_var("EXT_SUFFIX"))')" || \
  (python3 setup.py build_ext --inplace > $O/build_ext.log 2>&1 || tail -20 $O/build_ext.log)
python3 -c "
from voodoo.llamacpp import build_lib, build_tools, PIPELINE_TOOLS
import os
print(build_lib()); os.environ.get('LIBONLY') or print(build_tools(tools=PIPELINE_TOOLS))" > $O/bootstrap.log 2>&1 || tail -30 $O/bootstrap.log
echo "[gpu] built in $(( $(date +%s) - t0 )) s" | tee -a $O/progress.txt
