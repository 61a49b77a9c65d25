#!/usr/bin/env bash
# Starts a decoupled run over SSH, one detached tmux session per process.
#
#   experiments/deploy/ssh/launch.sh cluster.env          # start everything
#   DRY_RUN=1 experiments/deploy/ssh/launch.sh cluster.env  # print the commands only
#   experiments/deploy/ssh/launch.sh cluster.env stop     # end every session of the run
#
# Sessions: dd-syncer-S on each syncer host, dd-island-I-K on each island host; attach with
# `ssh HOST -t tmux attach -t NAME`. Secrets never appear on a command line: a syncer reads the
# run token from TOKEN_FILE on its host; an island's hosts never see the run token, only their
# learner's credential (it can act only as that learner), which this script derives from the
# run token here (TOKEN_FILE on this machine) and writes to CREDENTIAL_FILE.ID on each of them
# (mode 600) before starting them. Either is read into DD_RUN_TOKEN. See docs/deploy.md.
set -euo pipefail

env_file=${1:?usage: launch.sh CLUSTER_ENV [stop]}
action=${2:-start}
# shellcheck source=/dev/null
source "$env_file"
# (a cluster.env written before learner credentials existed has no CREDENTIAL_FILE)
CREDENTIAL_FILE=${CREDENTIAL_FILE:-'~/.dd_learner_credential'}

run() {  # run HOST SESSION SECRET_FILE COMMAND
  local host=$1 session=$2 secret=$3 command=$4
  if [[ $action == stop ]]; then
    remote="tmux kill-session -t $session 2>/dev/null || true"
  else
    remote="tmux new-session -d -s $session $(printf %q "cd $REPO && DD_RUN_TOKEN=\$(cat $secret) exec .venv/bin/python -m $command")"
  fi
  if [[ -n ${DRY_RUN:-} ]]; then
    echo "$host	$session	$secret	$command"
  else
    ssh "$host" "$remote"
  fi
}

give_credential() {  # give_credential HOST LEARNER_ID: its credential to CREDENTIAL_FILE.ID there
  local host=$1 id=$2 credential
  [[ $action == stop || -n ${DRY_RUN:-} ]] && return 0
  # comm/auth.py needs only the standard library: run as a file, it needs no installed package.
  credential=$(DD_RUN_TOKEN=$(cat "${TOKEN_FILE/#\~/"$HOME"}") python3 "$root/decoupled_diloco/comm/auth.py" "$id")
  # One file per learner id (a home shared between hosts must not mix islands); made anew, so
  # that it is created under the umask whatever an older file's mode was.
  printf '%s\n' "$credential" | ssh "$host" "rm -f $CREDENTIAL_FILE.$id && umask 077 && cat > $CREDENTIAL_FILE.$id"
}

root=$(cd "$(dirname "$0")/../../.." && pwd)
read -r -a syncers <<<"$SYNCER_HOSTS"
addresses=""
for s in "${!syncers[@]}"; do
  addresses+="${addresses:+,}${syncers[$s]}:$SYNCER_PORT"
  run "${syncers[$s]}" "dd-syncer-$s" "$TOKEN_FILE" "decoupled_diloco.syncer $CONFIG_ARGS $SYNCER_ARGS --host=0.0.0.0 --port=$SYNCER_PORT --shard=$s --checkpoint_dir=$WORKDIR/checkpoints/syncer_$s"
done

for i in "${!ISLANDS[@]}"; do
  read -r -a hosts <<<"${ISLANDS[$i]}"
  coordinator="${hosts[0]}:$COORDINATOR_PORT"
  for k in "${!hosts[@]}"; do
    give_credential "${hosts[$k]}" "$i"
    run "${hosts[$k]}" "dd-island-$i-$k" "$CREDENTIAL_FILE.$i" "decoupled_diloco.learner $CONFIG_ARGS --syncer=$addresses --learner_id=$i --coordinator=$coordinator --num_processes=${#hosts[@]} --process_id=$k --workdir=$WORKDIR"
  done
done
