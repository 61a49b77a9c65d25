#!/usr/bin/env bash
# Starts a decoupled run over SSH, one detached tmux session per process.
#
#   experiments/deploy/ssh/launch.sh cluster.env          # start everything
#   DRY_RUN=1 experiments/deploy/ssh/launch.sh cluster.env  # print the commands only
#   experiments/deploy/ssh/launch.sh cluster.env stop     # end every session of the run
#
# Sessions: dd-syncer-S on each syncer host, dd-island-I-K on each island host; attach with
# `ssh HOST -t tmux attach -t NAME`. The run token is read on each host from TOKEN_FILE into
# DD_RUN_TOKEN, so it never appears on a command line. See docs/deploy.md.
set -euo pipefail

env_file=${1:?usage: launch.sh CLUSTER_ENV [stop]}
action=${2:-start}
# shellcheck source=/dev/null
source "$env_file"

run() {  # run HOST SESSION COMMAND
  local host=$1 session=$2 command=$3
  if [[ $action == stop ]]; then
    remote="tmux kill-session -t $session 2>/dev/null || true"
  else
    remote="tmux new-session -d -s $session $(printf %q "cd $REPO && DD_RUN_TOKEN=\$(cat $TOKEN_FILE) exec .venv/bin/python -m $command")"
  fi
  if [[ -n ${DRY_RUN:-} ]]; then
    echo "$host	$session	$command"
  else
    ssh "$host" "$remote"
  fi
}

read -r -a syncers <<<"$SYNCER_HOSTS"
addresses=""
for s in "${!syncers[@]}"; do
  addresses+="${addresses:+,}${syncers[$s]}:$SYNCER_PORT"
  run "${syncers[$s]}" "dd-syncer-$s" "decoupled_diloco.syncer $CONFIG_ARGS $SYNCER_ARGS --host=0.0.0.0 --port=$SYNCER_PORT --shard=$s --checkpoint_dir=$WORKDIR/checkpoints/syncer_$s"
done

for i in "${!ISLANDS[@]}"; do
  read -r -a hosts <<<"${ISLANDS[$i]}"
  coordinator="${hosts[0]}:$COORDINATOR_PORT"
  for k in "${!hosts[@]}"; do
    run "${hosts[$k]}" "dd-island-$i-$k" "decoupled_diloco.learner $CONFIG_ARGS --syncer=$addresses --learner_id=$i --coordinator=$coordinator --num_processes=${#hosts[@]} --process_id=$k --workdir=$WORKDIR"
  done
done
