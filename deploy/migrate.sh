#!/bin/sh
# Apply the database migrations of the services named (default: all four), one after the
# other; stops at the first that fails (its exit code). The release step of the image:
# the compose file's `migrate` service and the Kubernetes Job run it once, before the services
# start with LOOPLINE_AUTO_MIGRATE=false.
set -eu
[ "$#" -gt 0 ] || set -- gateway orchestrator billing tools
for service in "$@"; do
  echo "migrate: $service"
  python -m "services.$service" migrate
done
