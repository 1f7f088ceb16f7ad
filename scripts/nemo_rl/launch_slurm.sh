#!/usr/bin/env bash
# A multi-node NeMo RL GRPO run on Slurm, in the style of NeMo RL's own ray.sub launches
# (examples/nemo_gym/launch_nemo_gym_multinode_training.sh): the rollout service on a CPU node of its own
# (prorl_serve.sub), then NeMo RL's ray.sub on the GPU nodes with launch.sh as its COMMAND, relaying to it.
#
#   NEMO_RL_DIR=~/RL CONTAINER_IMAGE_PATH=... SLURM_ACCOUNT=... SLURM_PARTITION=batch \
#   CPU_PARTITION=cpu RECIPE=swe NUM_ACTOR_NODES=4 EXP_NAME=prorl-swe scripts/nemo_rl/launch_slurm.sh [OVERRIDES...]
#
# Everything lives on a filesystem all nodes see (this checkout, NeMo RL's, the data and results). The token
# (PRORL_SERVICE_TOKEN, made here when unset) goes to both jobs; NeMo RL's Gym actor gets it, and
# NEMO_GYM_EXTRA_ROOTS, from the driver's environment (Ray runtime_env). --dry-run prints the two submissions.
set -euo pipefail

PRORL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DRY_RUN=0
if [[ "${1:-}" == --dry-run ]]; then DRY_RUN=1; shift; fi
: "${NEMO_RL_DIR:?NeMo RL's checkout}" "${SLURM_ACCOUNT:?}" "${SLURM_PARTITION:?the GPU partition}"
: "${CPU_PARTITION:?the partition of the rollout node}" "${CONTAINER_IMAGE_PATH:?NeMo RL's container}"
RECIPE="${RECIPE:-swe}"
NUM_ACTOR_NODES="${NUM_ACTOR_NODES:-4}"
EXP_NAME="${EXP_NAME:-prorl-$RECIPE}"
new_token() { "$PRORL_ROOT/.venv/bin/python" -c 'import secrets; print(secrets.token_hex(16))'; }
export PRORL_SERVICE_TOKEN="${PRORL_SERVICE_TOKEN:-$(new_token)}"
export PRORL_ROOT PRORL_SERVICE_URL_FILE="$PRORL_ROOT/results/$EXP_NAME/prorl_service.url"

run() { printf '%q ' "$@" | sed 's/ $//'; echo; if [[ $DRY_RUN -eq 0 ]]; then "$@"; fi; }

run mkdir -p "$(dirname "$PRORL_SERVICE_URL_FILE")"
run rm -f "$PRORL_SERVICE_URL_FILE"
run sbatch --account="$SLURM_ACCOUNT" --partition="$CPU_PARTITION" --job-name="$EXP_NAME-serve" \
  --output="$PRORL_ROOT/results/$EXP_NAME/serve-%j.log" "$PRORL_ROOT/scripts/nemo_rl/prorl_serve.sub"

if [[ $DRY_RUN -eq 0 ]]; then
  echo "waiting for the rollout service to answer (its URL in $PRORL_SERVICE_URL_FILE) ..."
  until [[ -s "$PRORL_SERVICE_URL_FILE" ]]; do sleep 10; done
  SERVICE_URL="$(cat "$PRORL_SERVICE_URL_FILE")"
else
  SERVICE_URL='$(cat '"$PRORL_SERVICE_URL_FILE"')'
fi

# ray.sub's COMMAND runs on the Ray head node: launch.sh exports the environment, writes the rows, starts NeMo RL.
COMMAND="$PRORL_ROOT/scripts/nemo_rl/launch.sh --recipe $RECIPE --nemo-rl-dir $NEMO_RL_DIR --service-url $SERVICE_URL"
COMMAND+=" -- ++cluster.num_nodes=$NUM_ACTOR_NODES ++logger.log_dir=results/$EXP_NAME"
COMMAND+=" ++checkpointing.checkpoint_dir=results/$EXP_NAME $*"
# Both checkouts are mounted into NeMo RL's container (and this venv's interpreter must be found there too: Gym
# starts our agent with it).
mount_of() { findmnt -n -o TARGET --target "$1" 2>/dev/null || echo "$1"; }
MOUNTS="$(mount_of "$NEMO_RL_DIR"):$(mount_of "$NEMO_RL_DIR"),$(mount_of "$PRORL_ROOT"):$(mount_of "$PRORL_ROOT")"
echo "COMMAND=$COMMAND"
echo "MOUNTS=$MOUNTS"
cd "$NEMO_RL_DIR"
COMMAND="$COMMAND" CONTAINER="$CONTAINER_IMAGE_PATH" MOUNTS="$MOUNTS" \
  run sbatch --nodes="$NUM_ACTOR_NODES" --account="$SLURM_ACCOUNT" --partition="$SLURM_PARTITION" --time=4:0:0 \
  --job-name="$EXP_NAME" --gres=gpu:8 ray.sub
