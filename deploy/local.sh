#!/usr/bin/env bash
# Local rehearsal of deploy/k8s: the same three entrypoints and the same config file, as three
# processes on loopback (the config's own addresses; the cluster overrides only hosts, addresses,
# Ray address, device and --tp). One process exiting stops the others; Ctrl-C / SIGTERM stops all
# three (each drains for grpc.shutdown_grace_s).
#
#   deploy/local.sh [CONFIG]      CONFIG defaults to deploy/specdec.yaml
#   SPECDEC="python -m orchestrator.cli" deploy/local.sh    # without the installed console script
#   RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=FILE deploy/local.sh   # the front's Ray with token auth, as in the pods
set -euo pipefail
config="${1:-$(dirname "$0")/specdec.yaml}"
specdec="${SPECDEC:-specdec}"
pids=()

stop() {
  trap - INT TERM EXIT
  kill -TERM "${pids[@]}" 2>/dev/null || true
  wait || true
}
trap 'stop; exit 143' INT TERM
trap stop EXIT

$specdec draft-server --config "$config" & pids+=($!)
$specdec target-server --config "$config" & pids+=($!)
$specdec front --config "$config" & pids+=($!)
wait -n
