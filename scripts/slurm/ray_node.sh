#!/usr/bin/env bash
# One Slurm node's share of the rollout service's Ray cluster; prorl_ray.sbatch runs it with srun, one task per node:
#   ray_node.sh head     the Ray head (GCS) at $RAY_HEAD_IP:$RAY_PORT, plus RAY_NODES_PER_HOST-1 more Ray nodes
#   ray_node.sh worker   RAY_NODES_PER_HOST Ray nodes joined to that head
#   ray_node.sh make-job-dir   only make this node's job folder (what the others do first)
# Each Ray node is a `ray start --block` in the foreground of this script, so every Ray process (raylet, workers,
# the rollout actors and their sandboxes) stays in the Slurm step's process tree: a scancel's SIGTERM/SIGKILL
# reaches all of them. More than one Ray node per host is for trying multi-node behaviour on one machine.
# Environment (set by prorl_ray.sbatch): PRORL_ROOT, PRORL_JOB_DIR, RAY_TEMP_DIR and TMPDIR (in it), SANDBOX,
# RAY_HEAD_IP, RAY_PORT, RAY_NODES_PER_HOST, RAY_CPUS_PER_NODE, RAY_HEAD_CPUS, RAY_OBJECT_STORE_MB.
set -euo pipefail

role="${1:?head, worker or make-job-dir}"
# The job's folder on this node: Ray's session, and the sandboxes' TMPDIR, which their unprivileged users pass through
mkdir -p "$RAY_TEMP_DIR" "$TMPDIR"
chmod 755 "$PRORL_JOB_DIR"
chmod 1777 "$TMPDIR"
[[ "$role" == make-job-dir ]] && exit 0
ray="$PRORL_ROOT/.venv/bin/ray"

# Free ports for the agents every Ray node runs (their fixed defaults would collide between Ray nodes on one host,
# or with another Ray cluster on a shared node), and for the head's dashboard and client server: asked for at once.
mapfile -t ports < <("$PRORL_ROOT/.venv/bin/python" -c '
import socket, sys
held = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in held:
    s.bind(("", 0))
print("\n".join(str(s.getsockname()[1]) for s in held))
' $((4 * RAY_NODES_PER_HOST + 2)))
next_port() { port=${ports[0]}; ports=("${ports[@]:1}"); }

# One Ray node's options (into the array `args`): its CPUs ($1), object store, session folder and agent ports.
node_args() {
  args=(--block --disable-usage-stats --temp-dir="$RAY_TEMP_DIR" --num-cpus="$1"
    --object-store-memory=$((RAY_OBJECT_STORE_MB * 1024 * 1024)))
  local option
  for option in dashboard-agent-listen-port dashboard-agent-grpc-port runtime-env-agent-port metrics-export-port; do
    next_port
    args+=("--$option=$port")
  done
}

# Stopping (scancel, or one Ray node ended): every Ray process of this script at once, then the sandboxes its rollout
# workers held are swept from the node and the job's folder removed (stop_node.py), within Slurm's KillWait.
pids=()
stop_nodes() { "$PRORL_ROOT/.venv/bin/python" "$PRORL_ROOT/scripts/slurm/stop_node.py" "${pids[@]}"; wait || true; }
trap 'stop_nodes; exit 143' TERM INT

joined=$RAY_NODES_PER_HOST
if [[ "$role" == head ]]; then
  node_args "${RAY_HEAD_CPUS:-$RAY_CPUS_PER_NODE}"
  next_port && args+=(--dashboard-port="$port")
  next_port && args+=(--ray-client-server-port="$port")
  "$ray" start --head --node-ip-address="$RAY_HEAD_IP" --port="$RAY_PORT" --include-dashboard=false "${args[@]}" &
  pids+=($!)
  joined=$((RAY_NODES_PER_HOST - 1))
  # `ray start` writes the head's address there once the head is up (prorl_ray.sbatch removed any older one)
  until [[ -s "$RAY_TEMP_DIR/ray_current_cluster" ]]; do
    kill -0 "${pids[0]}" 2>/dev/null || { echo "ray_node.sh: the Ray head exited" >&2; exit 1; }
    sleep 1
  done
fi
for ((i = 0; i < joined; i++)); do
  node_args "$RAY_CPUS_PER_NODE"
  "$ray" start --address="$RAY_HEAD_IP:$RAY_PORT" "${args[@]}" &
  pids+=($!)
done

# Whichever Ray node stops first ends this task (and so the Slurm step): the job script sees it and stops.
status=0
wait -n "${pids[@]}" || status=$?
echo "ray_node.sh: a Ray node on $(hostname) stopped (exit $status)" >&2
stop_nodes
exit "$status"
