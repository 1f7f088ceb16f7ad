#!/usr/bin/env bash
# A NeMo RL GRPO run through NeMo Gym and our rollout agents, from one of the recipes in recipes/grpo/.
#
# Run it where NeMo RL's driver runs: the machine itself for one node, or as the COMMAND of NeMo RL's ray.sub on
# a Slurm allocation (scripts/nemo_rl/launch_slurm.sh). It
#   1. exports what the recipe and NeMo RL's Gym actor read: NEMO_RL_DIR, PRORL_DATA_DIR, NEMO_GYM_EXTRA_ROOTS (our
#      plugin root; NeMo RL hands the driver's whole environment to its Gym actor through Ray's runtime_env, so the
#      export here reaches Gym on whichever node the actor lands), NEMO_GYM_VENV_DIR (venv links: Gym starts our
#      agent and its own servers from this checkout's venv, offline) and PRORL_SERVICE_TOKEN as it is set;
#   2. links the venvs and writes the task's rows (prorl data export: train and validation);
#   3. starts examples/nemo_gym/run_grpo_nemo_gym.py in NeMo RL's checkout with the recipe and any extra overrides.
#
#   scripts/nemo_rl/launch.sh --recipe math --nemo-rl-dir ~/RL                       # one GPU, service in Gym
#   scripts/nemo_rl/launch.sh --recipe swe --nemo-rl-dir ~/RL --service-url http://rollout-node:8100
#   scripts/nemo_rl/launch.sh --recipe math --nemo-rl-dir ~/RL --dry-run -- ++grpo.max_num_steps=5
#
# Options (environment variables of the same meaning in brackets):
#   --recipe NAME          a recipe under recipes/grpo/ (math, code, stem, swe; each also NAME_async)
#   --nemo-rl-dir DIR      NeMo RL's checkout [NEMO_RL_DIR]
#   --data-dir DIR         where the rows go [PRORL_DATA_DIR; default <this checkout>/results/nemo_rl_data]
#   --service-url URL      the relay's `prorl serve` (swe recipes: rollouts on the rollout nodes)
#   --uv-run CMD           how NeMo RL's python is run [NEMO_RL_RUN; default "uv run python"]
#   --dry-run              print the environment and the commands instead of running them
#   -- OVERRIDES...        passed to run_grpo_nemo_gym.py (NeMo RL's ++key=value overrides)
set -euo pipefail

PRORL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PRORL_PYTHON="${PRORL_PYTHON:-$PRORL_ROOT/.venv/bin/python}"
RECIPE=""
SERVICE_URL=""
DRY_RUN=0
NEMO_RL_DIR="${NEMO_RL_DIR:-}"
PRORL_DATA_DIR="${PRORL_DATA_DIR:-$PRORL_ROOT/results/nemo_rl_data}"
NEMO_RL_RUN="${NEMO_RL_RUN:-uv run python}"

usage_error() { echo "launch.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --recipe) RECIPE="${2:?--recipe needs a name}"; shift 2 ;;
    --nemo-rl-dir) NEMO_RL_DIR="${2:?--nemo-rl-dir needs a directory}"; shift 2 ;;
    --data-dir) PRORL_DATA_DIR="${2:?--data-dir needs a directory}"; shift 2 ;;
    --service-url) SERVICE_URL="${2:?--service-url needs a URL}"; shift 2 ;;
    --uv-run) NEMO_RL_RUN="${2:?--uv-run needs a command}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) usage_error "unknown option $1 (--help lists them)" ;;
  esac
done
OVERRIDES=("$@")

# Each task type: its task and the agent that runs its rows; its recipes: recipes/grpo/<type>.yaml, <type>_async.yaml.
declare -A TASKS=([math]=math/arithmetic [code]=code/humaneval [swe]=swe/offline
                  [stem]=stem/algebra,stem/decimals,stem/geometry,stem/units)
declare -A AGENTS=([math]=prorl_agent [code]=prorl_agent [stem]=prorl_agent [swe]=prorl_service_agent)
recipes=""
for type in $(printf '%s\n' "${!TASKS[@]}" | sort); do
  for name in "$type" "${type}_async"; do [[ -f "$PRORL_ROOT/recipes/grpo/$name.yaml" ]] && recipes+="$name "; done
done
[[ -n "$RECIPE" ]] || usage_error "--recipe is required: one of ${recipes% }"
TASK_TYPE="${RECIPE%_async}"
[[ " $recipes" == *" $RECIPE "* ]] || usage_error "unknown recipe '$RECIPE': one of ${recipes% }"
[[ -n "$NEMO_RL_DIR" ]] || usage_error "NeMo RL's checkout is needed: --nemo-rl-dir DIR or NEMO_RL_DIR"
RECIPE_FILE="$PRORL_ROOT/recipes/grpo/$RECIPE.yaml"
TASK="${TASKS[$TASK_TYPE]}"
AGENT="${AGENTS[$TASK_TYPE]}"
if [[ "$AGENT" == prorl_service_agent ]]; then
  [[ -n "$SERVICE_URL" ]] || usage_error "recipe '$RECIPE' relays to a running \`prorl serve\`: --service-url URL"
  OVERRIDES=("++env.nemo_gym.prorl_service_agent.responses_api_agents.prorl_service.url=$SERVICE_URL" "${OVERRIDES[@]}")
fi

export NEMO_RL_DIR PRORL_DATA_DIR
export NEMO_GYM_EXTRA_ROOTS="$PRORL_ROOT/nemo_gym_prorl/gym${NEMO_GYM_EXTRA_ROOTS:+:$NEMO_GYM_EXTRA_ROOTS}"
export NEMO_GYM_VENV_DIR="${NEMO_GYM_VENV_DIR:-$PRORL_ROOT/.venv/gym-venvs}"

run() {  # one command: printed, then run unless --dry-run
  printf '%q ' "$@" | sed 's/ $//'
  echo
  if [[ $DRY_RUN -eq 0 ]]; then "$@"; fi
}

echo "# environment"
for name in NEMO_RL_DIR PRORL_DATA_DIR NEMO_GYM_EXTRA_ROOTS NEMO_GYM_VENV_DIR; do
  echo "export $name=$(printf '%q' "${!name}")"
done
[[ -n "${PRORL_SERVICE_TOKEN:-}" ]] && echo "export PRORL_SERVICE_TOKEN=<set>"
echo "# commands"
run "$PRORL_PYTHON" -m nemo_gym_prorl.gym.venvs --venvs-dir "$NEMO_GYM_VENV_DIR"
for split in train validation; do
  run "$PRORL_PYTHON" -m nemo_gym_prorl.cli data export "task=$TASK" "split=$split" \
    "output=$PRORL_DATA_DIR/$TASK_TYPE/$split.jsonl" "agent=$AGENT"
done
run cd "$NEMO_RL_DIR"
# shellcheck disable=SC2086  # NEMO_RL_RUN is a command line ("uv run python")
run $NEMO_RL_RUN examples/nemo_gym/run_grpo_nemo_gym.py --config "$RECIPE_FILE" "${OVERRIDES[@]}"
