#!/usr/bin/env bash
# The single-machine fallback of the ARC scale sets (docs/ci.md): one GPU machine, one runner that
# takes exactly one job (`config.sh --ephemeral`), then is registered again from a clean copy.
# Started by ephemeral-runner.service as root, which alone holds the credential that mints
# registration tokens; the runner and the job run as RUNNER_USER, whose processes, caches and
# temporary files are removed before the next registration.
# Needs: RUNNER_HOME (an unpacked actions runner, never modified), RUNNER_URL (the organisation),
# RUNNER_GROUP, RUNNER_LABEL (e.g. h200-untrusted), RUNNER_USER, and RUNNER_TOKEN_COMMAND, a
# root-only command that prints a fresh registration token.
set -euo pipefail

: "${RUNNER_HOME:?}" "${RUNNER_URL:?}" "${RUNNER_GROUP:?}" "${RUNNER_LABEL:?}" "${RUNNER_USER:?}"
: "${RUNNER_TOKEN_COMMAND:?}"
home=$(getent passwd "$RUNNER_USER" | cut -d: -f6)
work=$(mktemp -d /var/tmp/runner.XXXXXX)

clean() {
    # Whatever the last job left: its processes, its runner copy, caches and temporary files.
    pkill -KILL -u "$RUNNER_USER" || true
    rm -rf "$work" "$home/.cache" "$home/.triton" "$home/.nv" "$home/.local"
    find /tmp /var/tmp /dev/shm -mindepth 1 -user "$RUNNER_USER" -delete 2>/dev/null || true
}
clean
trap clean EXIT

mkdir -p "$work"
cp -a "$RUNNER_HOME/." "$work/"
chown -R "$RUNNER_USER:" "$work"
cd "$work"
token=$(bash -c "$RUNNER_TOKEN_COMMAND")
runuser -u "$RUNNER_USER" -- ./config.sh --unattended --ephemeral --disableupdate --replace \
    --url "$RUNNER_URL" --token "$token" --runnergroup "$RUNNER_GROUP" \
    --labels "$RUNNER_LABEL" --name "$RUNNER_LABEL-$(hostname)" --work "$work/_work"
unset token
runuser -u "$RUNNER_USER" -- ./run.sh
