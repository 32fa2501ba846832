#!/usr/bin/env bash
# The compose stack from one command. `up` builds the local images (offline, content-hashed:
# seconds when nothing changed), starts the stack with the CPU profile, and follows the
# trainer's log until the demo run's last step; then prints the ledger.
#   scripts/stack.sh up | down | images | status | scale N | env | worker-host [up args]
#   scripts/stack.sh submit CONFIG [--resume] [--inference auto|shared|own] | logs RUN [--follow] | stop RUN | list: a run beside the first
#   (RUN_INFERENCE_PUBLISH=ADDRESS:PORT publishes the submitted run's own vLLM to workers on other hosts)
# `worker-host` starts only rollout workers, pointed at the head host CONVEYOR_HEAD through its
# published ports (compose/worker-host.yml); PROJECT defaults to conveyor-workers there. It
# records the project in compose/.worker-hosts, and `down` stops every worker-host project
# started from this checkout on this daemon (recorded, or found by compose's labels) first.
# Stack id: CONVEYOR_STACK_ID, default <PROJECT>-<hash of this checkout's path>; every image,
# sandbox and volume the stack makes is labelled conveyor.stack=<it>, and cleanup (image
# pruning, the sandbox janitor) touches only its own stack's (docs/compose.md, shared/stack_id.py).
# `swarm` deploys the same stack with `docker stack deploy` (a swarm must exist: docker swarm init).
# Settings: compose/.env (copied from compose/.env.example on first use). ENV_DIR (default compose)
# is the folder of .env and of what the script writes beside it (images.env, .stack.env,
# .worker-hosts, .swarm.yml): a second stack of one checkout, with settings of its own, gets its own folder.
# COMPOSE (default: `docker compose` if present, else docker-compose), PROFILE (cpu|gpu).
set -euo pipefail
CALLED_FROM=$PWD  # where a relative CONFIG of `submit` is
cd "$(dirname "$(readlink -f "$0")")/.."  # the checkout, also when scripts/ is reached through a link
PY=${PY:-.venv/bin/python}
PROFILE=${PROFILE:-cpu}
PROJECT=${PROJECT:-conveyor}
ENV_DIR=${ENV_DIR:-compose}
if [ -z "${COMPOSE:-}" ]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"; else COMPOSE="docker-compose"; fi
fi

env_file() {
  mkdir -p "$ENV_DIR"
  [ -f "$ENV_DIR/.env" ] || { cp compose/.env.example "$ENV_DIR/.env"; echo "[stack] wrote $ENV_DIR/.env from .env.example: change its secrets"; }
  [ -f "$ENV_DIR/images.env" ] || images
  { cat "$ENV_DIR/.env"; cat "$ENV_DIR/images.env"; echo "DOCKER_GID=$(stat -c %g /var/run/docker.sock)"
    echo "CONVEYOR_STACK_ID=$(stack_id)"; } > "$ENV_DIR/.stack.env"
}

# the stack id of PROJECT from this checkout: two checkouts, or two projects, differ
stack_id() { echo "${CONVEYOR_STACK_ID:-$PROJECT-$(pwd -P | sha256sum | cut -c1-8)}"; }

images() { mkdir -p "$ENV_DIR"; CONVEYOR_STACK_ID=$(stack_id) "$PY" -m services.cli.stack_images --env-file "$ENV_DIR/images.env"; }

# the ledger on the `cluster` profile's Redis Cluster (docs/compose.md, "Redis Cluster"), when the
# settings say so: its six nodes are then part of every compose call, up to down
ledger_on_cluster() { grep -Eq "^LEDGER_REDIS_SCHEME=[\"']?redis\+cluster" "$ENV_DIR/.stack.env" 2>/dev/null; }

dc() {
  local cluster=()
  ! ledger_on_cluster || cluster=(--profile cluster)
  $COMPOSE -p "$PROJECT" --env-file "$ENV_DIR/.stack.env" -f compose/docker-compose.yml ${OVERRIDE:+-f "$OVERRIDE"} --profile "$PROFILE" "${cluster[@]}" "$@"
}

WORKER_HOSTS=$ENV_DIR/.worker-hosts  # worker-host projects started from this checkout, one a line

# worker-host projects of this checkout on this daemon: recorded by `worker-host`, or (started
# before the record existed) found by the working_dir and config_files labels compose puts on them
worker_host_projects() {
  { [ ! -f "$WORKER_HOSTS" ] || cat "$WORKER_HOSTS"
    docker ps -a --filter "label=com.docker.compose.project.working_dir=$(pwd -P)/compose" \
      --format '{{.Label "com.docker.compose.project"}} {{.Label "com.docker.compose.project.config_files"}}' |
      awk '$2 ~ /worker-host\.yml/ {print $1}'; } | sort -u
}

# worker-host.yml only re-points the workers' endpoints: the base file alone brings one down
down_worker_hosts() {
  local project
  for project in $(worker_host_projects); do
    [ "$project" != "$PROJECT" ] || continue
    echo "[stack] stopping worker-host project $project"
    PROJECT=$project dc down "$@" || { echo "[stack] could not stop $project: PROJECT=$project $0 down" >&2; return 1; }
    sed -i "/^$project\$/d" "$WORKER_HOSTS" 2>/dev/null || true
  done
}

# agent_coding: the rollout workers' proxy sockets, bind-mounted at the same path on both sides
# (the daemon resolves the sandboxes' mounts on the host); sticky and writable by all, like /tmp
agent_sockets() { install -d -m 1777 /tmp/conveyor-agents 2>/dev/null || true; }

# inside a submit's container: the stack's endpoints stay, every other CONVEYOR_* variable of the
# service (the stack's own run: its run id, group size, steps) goes, since a variable beats the
# value in CONFIG; Prometheus too (the run's trainer and follower share the container)
SUBMIT_KEEPS='CONVEYOR_REDIS__*|CONVEYOR_STORAGE__*|CONVEYOR_INFERENCE__BASE_URL|CONVEYOR_INFERENCE__MODEL|CONVEYOR_INFERENCE__DTYPE|CONVEYOR_INFERENCE__MAX_MODEL_LEN|CONVEYOR_STACK_ID|CONVEYOR_RUNS_DIR'
SUBMIT_IN_CONTAINER='for name in $(env | sed -n "s/^\(CONVEYOR_[A-Z0-9_]*\)=.*/\1/p"); do case $name in '"$SUBMIT_KEEPS"') ;; *) unset "$name" ;; esac; done; exec conveyor run submit "$@"'

case "${1:-up}" in
  images) images ;;
  env) images; env_file; echo "$ENV_DIR/.stack.env" ;;
  up)
    images
    env_file
    agent_sockets
    if ledger_on_cluster; then  # the services read redis.url as a cluster at once: joined first
      echo "[stack] the ledger's Redis Cluster: six nodes, joined (a no-op once they are)"
      dc run --rm -T redis-cluster-create
    fi
    dc up -d
    echo "[stack] up; Flower: http://$(grep -E '^FLOWER_PUBLISH=' "$ENV_DIR/.stack.env" | cut -d= -f2 || echo 127.0.0.1:5555)"
    dc logs -f --no-color trainer &
    logs=$!
    status=$(docker wait "$(dc ps -q trainer)")
    kill "$logs" 2>/dev/null || true
    dc exec -T scorer conveyor status || true
    echo "[stack] trainer exited with $status; the stack keeps running (scripts/stack.sh down stops it)"
    exit "$status"
    ;;
  status) env_file; dc exec -T scorer conveyor status ;;
  scale)
    # only the rollout workers: a plain `up --scale` would also start the one-shot intake and
    # trainer again (they exited when the demo run ended)
    : "${2:?usage: $0 scale N (rollout workers)}"
    env_file
    dc up -d --no-deps --no-recreate --scale "rollout-worker=$2" rollout-worker
    echo "[stack] $2 rollout workers"
    ;;
  down)
    env_file
    # a head's down stops this checkout's worker-host projects first; a worker-host's, only itself
    grep -qx "$PROJECT" <<< "$(worker_host_projects)" || down_worker_hosts "${@:2}"
    dc down "${@:2}"
    sed -i "/^$PROJECT\$/d" "$WORKER_HOSTS" 2>/dev/null || true
    ;;
  worker-host)
    : "${CONVEYOR_HEAD:?set CONVEYOR_HEAD to the address of the head host}"
    images
    env_file
    agent_sockets
    [ "$PROJECT" != conveyor ] || PROJECT=conveyor-workers
    OVERRIDE=compose/worker-host.yml
    dc run --rm model-init
    grep -qx "$PROJECT" "$WORKER_HOSTS" 2>/dev/null || echo "$PROJECT" >> "$WORKER_HOSTS"
    dc up -d --no-deps "${@:2}" rollout-worker
    echo "[stack] rollout workers of project $PROJECT joined $CONVEYOR_HEAD"
    ;;
  swarm)
    # the same compose file on a swarm (docs/compose.md): rendered, then `docker stack deploy`
    images
    env_file
    "$PY" -m services.cli.swarm_file --compose "$COMPOSE" --env-file "$ENV_DIR/.stack.env" --profile "$PROFILE" --out "$ENV_DIR/.swarm.yml"
    docker stack deploy --resolve-image never -c "$ENV_DIR/.swarm.yml" "$PROJECT"
    ;;
  submit)
    # a run beside the stack's own (docs/compose.md): `conveyor run submit CONFIG` in a detached
    # container of the trainer's image; CONFIG's folder is mounted read-only at the same path, so
    # the paths in CONFIG (its dataset) work as they are
    config=$(cd "$CALLED_FROM" && realpath -e "${2:?usage: $0 submit CONFIG [--resume] [--inference auto|shared|own]}") || exit 2
    env_file
    folder=$(dirname "$config")
    # RUN_INFERENCE_PUBLISH=ADDRESS:PORT: a vLLM of the run's own listens on PORT, published on the
    # host's ADDRESS, and is named to the workers by it (for workers on other hosts)
    publish=() own=()
    if [ -n "${RUN_INFERENCE_PUBLISH:-}" ]; then
      [[ $RUN_INFERENCE_PUBLISH =~ ^(.+):([0-9]+)$ ]] || { echo "RUN_INFERENCE_PUBLISH=$RUN_INFERENCE_PUBLISH: expected ADDRESS:PORT" >&2; exit 2; }
      publish=(-p "$RUN_INFERENCE_PUBLISH:${BASH_REMATCH[2]}")
      own=(--inference-host "${BASH_REMATCH[1]}" --inference-port "${BASH_REMATCH[2]}")
    fi
    container=$(dc run -d --rm --no-deps "${publish[@]}" -v "$folder:$folder:ro" --entrypoint sh trainer -c "$SUBMIT_IN_CONTAINER" \
      submit "$config" "${@:3}" "${own[@]}")
    echo "[stack] submitted $config in container $container (its supervisor's output: docker logs -f $container)"
    echo "[stack] the run's logs: $0 logs RUN [--follow]; to stop it: $0 stop RUN"
    ;;
  logs)
    : "${2:?usage: $0 logs RUN [--process trainer|follower|intake] [--follow] [--lines N]}"
    env_file
    dc run --rm --no-deps -T trainer run logs "${@:2}"
    ;;
  stop)
    : "${2:?usage: $0 stop RUN [--reason WHY]}"
    env_file
    dc run --rm --no-deps -T trainer run stop "${@:2}"
    ;;
  list)
    env_file
    dc run --rm --no-deps -T trainer run list "${@:2}"
    ;;
  *) echo "usage: $0 up|down|images|status|scale N|env|worker-host|swarm|submit CONFIG|logs RUN|stop RUN|list" >&2; exit 2 ;;
esac
