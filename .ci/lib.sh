# Sourced by .ci/run and .ci/integrations.sh: phase timings, clean-up at exit, venvs built by uv.
#
#   phase NAME COMMAND...   run COMMAND; print `ci: NAME <seconds> s` (and `ci: NAME FAILED ...`)
#   ci_on_exit COMMAND      run COMMAND when the script exits, after the phase table
#   install_uv; use_uv      uv in .venv-uv, then on PATH
#   uv_venv DIR             a new venv made by uv (no pip in it)
#   uv_install DIR ARGS...  `uv pip install ARGS` into the venv DIR
#
# The phases of every script that sources this (in one CI run) go to one file; the script that
# sourced it first prints them all as a table, with the total, when it exits.

# torch's CPU build. uv reads no pip configuration, so it is given pip's find-links (where a machine
# may keep a local wheel of the CPU build) and TOKENGYM_TORCH_INDEX if set (e.g. PyTorch's CPU
# index); the local version label makes it the CPU build or nothing, never a CUDA download.
TORCH=${TOKENGYM_TORCH:-torch==2.13.0+cpu}
UV_VERSION=0.13.9
# uv writes no .pyc files by default (pip does); where PYTHONDONTWRITEBYTECODE is set, nothing else
# writes them either, and every process (a vLLM server, a Ray actor, a notebook's kernel, a CLI
# run) compiles torch, transformers and vLLM from source again: the vLLM tests took 27% longer.
export UV_COMPILE_BYTECODE=1

if [[ -z ${CI_PHASES_FILE:-} ]]; then
    export CI_PHASES_FILE
    CI_PHASES_FILE=$(mktemp "${TMPDIR:-/tmp}/tokengym-ci-phases.XXXXXX")
    CI_PHASES_OWNER=$$
    CI_START=$SECONDS
fi
CI_EXIT_COMMANDS=()

phase() {  # in a subshell with -e in force (a `cmd || ...` context would switch -e off inside it)
    local name=$1 start=$SECONDS status
    shift
    echo "ci: $name ..."
    set +e
    (set -e; "$@")
    status=$?
    set -e
    local took=$((SECONDS - start))
    if (( status )); then
        echo "ci: $name FAILED (exit $status) after $took s"
        printf '%s\t%s\tFAILED\n' "$name" "$took" >>"$CI_PHASES_FILE"
        exit "$status"
    fi
    echo "ci: $name $took s"
    printf '%s\t%s\tok\n' "$name" "$took" >>"$CI_PHASES_FILE"
}

ci_on_exit() { CI_EXIT_COMMANDS+=("$1"); }

_ci_exit() {
    local status=$?
    if [[ ${CI_PHASES_OWNER:-} == "$$" ]]; then
        echo "ci: ---- phases ----"
        awk -F'\t' '{printf "ci: %-28s %6d s  %s\n", $1, $2, $3}' "$CI_PHASES_FILE"
        echo "ci: total $((SECONDS - CI_START)) s (exit $status)"
        rm -f "$CI_PHASES_FILE"
    fi
    local cmd
    for cmd in "${CI_EXIT_COMMANDS[@]}"; do eval "$cmd"; done
    exit "$status"
}
trap _ci_exit EXIT

_uv_sources() {  # the find-links and index uv gets: pip's find-links, TOKENGYM_TORCH_INDEX
    local links=${PIP_FIND_LINKS:-}
    [[ -n $links ]] || links=$(python3 -m pip config get global.find-links 2>/dev/null || true)
    local word
    for word in $links; do printf -- '--find-links\n%s\n' "$word"; done
    if [[ -n ${TOKENGYM_TORCH_INDEX:-} ]]; then printf -- '--extra-index-url\n%s\n' "$TOKENGYM_TORCH_INDEX"; fi
}

install_uv() {  # uv itself, in a venv of its own (.venv-uv/bin goes on PATH: see use_uv)
    if [[ ! -x .venv-uv/bin/uv ]] || [[ $(.venv-uv/bin/uv --version) != "uv $UV_VERSION"* ]]; then
        python3 -m venv .venv-uv
        .venv-uv/bin/python -m pip install --quiet "uv==$UV_VERSION"
    fi
    .venv-uv/bin/uv --version
}

use_uv() { export PATH="$PWD/.venv-uv/bin:$PATH"; }

uv_venv() { uv venv --quiet --clear --python python3 "$1"; }

uv_install() {
    local venv=$1
    shift
    local sources=()
    mapfile -t sources < <(_uv_sources)
    uv pip install --quiet --python "$venv/bin/python" "${sources[@]}" "$@"
}
