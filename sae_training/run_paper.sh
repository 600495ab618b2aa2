#!/usr/bin/env bash
# The S3 paper's SAE training run for one model (issue 37; docs/SAE.md, "The paper's runs"):
#
#     bash sae_training/run_paper.sh MODEL [more train-sae options]
#
# MODEL: smollm2 | qwen2.5-coder-1.5b | gemma3-270m (config: sae_training/configs/paper_MODEL.yaml).
# Output in $OUT (default out/paper_MODEL, git-ignored): config.yaml, checkpoints/ (orbax, every 1,000 steps),
# curves.csv + curves.png (FVU, L0, dead fraction, AuxK loss per layer), paper_MODEL.safetensors + .json.
# The same command resumes an interrupted run from its newest checkpoint (--resume starts afresh in an
# empty $OUT). The model and the corpus are fetched (hash-checked) into $SPARSEKV_CACHE on first use:
# on a machine without network, fill that cache first (docs/SAE.md).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash sae_training/run_paper.sh MODEL [train-sae options]; MODEL: smollm2, qwen2.5-coder-1.5b, gemma3-270m" >&2
    exit 2
fi
model=$1
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
config="$here/configs/paper_${model}.yaml"
if [ ! -f "$config" ]; then
    echo "run_paper.sh: no config $config; MODEL is one of smollm2, qwen2.5-coder-1.5b, gemma3-270m" >&2
    exit 2
fi
exec "${PYTHON:-python}" "$here/train.py" --config "$config" --out "${OUT:-out/paper_${model}}" --resume "$@"
