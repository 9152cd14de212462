#!/usr/bin/env bash
# The single-machine fallback of the ARC scale sets (docs/ci.md): one GPU machine, one runner that
# takes exactly one job (`config.sh --ephemeral`), then is registered again from a clean copy.
# Started by ephemeral-runner.service as root; the runner and the job run as RUNNER_USER, whose
# processes, home, crontab, at jobs and temporary files are reset before every registration.
# Needs: RUNNER_HOME (an unpacked actions runner, never modified), RUNNER_URL (the organisation,
# or the repository where a person owns it), RUNNER_GROUP (empty without runner groups),
# RUNNER_LABEL (e.g. h200-untrusted), RUNNER_USER, and RUNNER_TOKEN_FILE: a file owned by root,
# mode 0600, holding a fresh registration token (written by the root-only timer in docs/ci.md).
# The token never appears on a command line: config.sh reads it from its environment.
set -euo pipefail

: "${RUNNER_HOME:?}" "${RUNNER_URL:?}" "${RUNNER_LABEL:?}" "${RUNNER_USER:?}" "${RUNNER_TOKEN_FILE:?}"
RUNNER_GROUP=${RUNNER_GROUP:-}
# The token file is root's alone; anything else is refused rather than read.
if [[ "$(stat -c '%u %a' "$RUNNER_TOKEN_FILE")" != "0 600" ]]; then
    echo "$RUNNER_TOKEN_FILE must be owned by root with mode 0600" >&2
    exit 1
fi

home=$(getent passwd "$RUNNER_USER" | cut -d: -f6)
work=$(mktemp -d /var/tmp/runner.XXXXXX)

clean() {
    # Whatever the last job left: its processes, scheduled jobs, home and temporary files.
    pkill -KILL -u "$RUNNER_USER" || true
    crontab -r -u "$RUNNER_USER" 2>/dev/null || true
    if command -v atq >/dev/null; then
        for job in $(atq -q a 2>/dev/null | awk -v u="$RUNNER_USER" '$NF == u {print $1}'); do atrm "$job"; done
    fi
    loginctl disable-linger "$RUNNER_USER" 2>/dev/null || true
    rm -rf "$work"
    # A fresh home from /etc/skel: no ~/.gitconfig, ~/.bashrc, caches or keys of the last job.
    if [[ -n "$home" && "$home" != / && -d "$home" ]]; then
        rm -rf "$home"
        cp -a /etc/skel "$home"
        chown -R "$RUNNER_USER:" "$home"
        chmod 0700 "$home"
    fi
    find /tmp /var/tmp /dev/shm -mindepth 1 -user "$RUNNER_USER" -delete 2>/dev/null || true
}
clean
trap clean EXIT

mkdir -p "$work"
cp -a "$RUNNER_HOME/." "$work/"
chown -R "$RUNNER_USER:" "$work"
cd "$work"
group=()
if [[ -n "$RUNNER_GROUP" ]]; then group=(--runnergroup "$RUNNER_GROUP"); fi
# runuser -u keeps the environment: the prefix assignment reaches config.sh and nothing after it.
ACTIONS_RUNNER_INPUT_TOKEN=$(<"$RUNNER_TOKEN_FILE") runuser -u "$RUNNER_USER" -- \
    ./config.sh --unattended --ephemeral --disableupdate --replace \
    --url "$RUNNER_URL" "${group[@]}" --labels "$RUNNER_LABEL" --name "$RUNNER_LABEL-$(hostname)" \
    --work "$work/_work"
runuser -u "$RUNNER_USER" -- ./run.sh
