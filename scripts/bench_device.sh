#!/usr/bin/env bash
# Benchmark a ~1B LLaMA train step in bf16 on one GPU (or TPU): tokens/s, MFU, peak memory
# and the attention kernel that ran. Uses the jax (with CUDA) already installed; extra
# arguments are train flags, e.g. --remat=full or --batch_size=4.
#   scripts/bench_device.sh
#   scripts/bench_device.sh --model=llama3_8b --batch_size=1 --remat=full
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import jax; assert jax.default_backend() != 'cpu', 'no accelerator: jax sees only ' + str(jax.devices())"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
PYTHONPATH=. python3 bench/bench_device.py "$@"
# The same model with rematerialisation, for its memory and cost.
PYTHONPATH=. python3 bench/bench_device.py --remat=full "$@"
# And with the block inputs in host memory: the device peak should drop by about their size.
PYTHONPATH=. python3 bench/bench_device.py --remat=offload "$@"
