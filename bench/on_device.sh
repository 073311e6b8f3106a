#!/usr/bin/env bash
# Issue 5's 16-core scaling check as the one command a session lent the device machine runs.
#
# That machine (16 cores, gVisor) has Python 3.12 with numpy, msgpack, matplotlib and
# prometheus-client, but not posix-ipc, and nothing can be fetched there. So, here, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl posix-ipc==1.3.2
# then the device tool's run(command="bash bench/on_device.sh", carry=[".whl"], timeout_s=420).
# kvd's C modules are compiled in place with the interpreter's own compiler settings rather than
# by pip, whose setuptools there may predate ext-modules in pyproject.toml; a module that does not
# build stops the run (measuring the pure-Python fallback would say nothing about kvd as shipped).
# Everything lands in $OUT (bench/results/device here): scaling.{json,png}, request_path.json,
# and log.txt with the machine's description and both benches' tables. About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/device}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

run() {
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvd-site .whl/*.whl
    export PYTHONPATH=/tmp/kvd-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

python3 - <<'EOF'
"""Compile every ext-module pyproject.toml declares, in place, as setuptools would."""
import os, shlex, shutil, subprocess, sysconfig, tomllib

config = sysconfig.get_config_vars()
# The compiler the interpreter was built with, unless that one is not on this machine (a
# relocatable build names its build host's): then $CC, gcc or cc.
compiler = shlex.split(os.environ.get("CC") or config["CC"])
if shutil.which(compiler[0]) is None:
    compiler = [next(name for name in ("gcc", "cc") if shutil.which(name))]
with open("pyproject.toml", "rb") as file:
    modules = tomllib.load(file)["tool"]["setuptools"]["ext-modules"]
for module in modules:
    target = module["name"].replace(".", "/") + config["EXT_SUFFIX"]
    command = [*compiler, *shlex.split(config["CCSHARED"]), "-shared",
               *module.get("extra-compile-args", []), f"-I{sysconfig.get_paths()['include']}",
               *module["sources"], "-o", target]
    print("building", target, flush=True)
    subprocess.run(command, check=True)
EOF
python3 -c "import kvd.protocol._wire, kvd._copy, kvd.core._pool, kvd.core.policies._s3fifo"

# The scaling pool takes 1 GiB of /dev/shm on 16 cores; a container's default is 64 MiB.
shm_free_kib=$(df -k --output=avail /dev/shm | tail -n 1)
if [ "$shm_free_kib" -lt $((2 * 1024 * 1024)) ]; then
    mount -o remount,size=8G /dev/shm || echo "== /dev/shm is small and could not be enlarged"
fi
echo "== $(nproc) CPUs; $(uname -srm); $(python3 -V)"
df -h /dev/shm
python3 -m bench.scaling --workers 1,2,4,8,16 --turns 5 --out "$out"
python3 -m bench.request_path --out "$out"
}
run 2>&1 | tee "$out/log.txt"  # (pipefail: the run's status; the log complete when this returns)
