#!/usr/bin/env bash
# Commit the files in DIR, a checkout of the asv results branch, and push them to BRANCH, so that
# the benchmark history accumulates one commit per benchmarked main commit. A push that loses a
# race is rebased and retried (results of different commits never touch the same file).
# Usage: push_results.sh DIR BRANCH MESSAGE   (GITHUB_TOKEN, when set, authenticates the push)
set -euo pipefail

if [[ $# -ne 3 ]]; then
    echo "usage: $0 DIR BRANCH MESSAGE" >&2
    exit 2
fi
dir=$1
branch=$2
message=$3

cd "$dir"
git add -A
if git diff --cached --quiet; then
    echo "no new results to push"
    exit 0
fi
git -c user.name="github-actions[bot]" -c user.email="41898282+github-actions[bot]@users.noreply.github.com" \
    commit --quiet -m "$message"

auth=()
if [[ -n "${GITHUB_TOKEN:-}" ]]; then
    # The token goes in a header for this command only, never into .git/config.
    basic=$(printf 'x-access-token:%s' "$GITHUB_TOKEN" | base64 -w0)
    auth=(-c "http.https://github.com/.extraheader=AUTHORIZATION: basic $basic")
fi
for attempt in 1 2 3; do
    if git "${auth[@]}" push origin "HEAD:refs/heads/$branch"; then
        echo "pushed $(git rev-parse --short HEAD) to $branch"
        exit 0
    fi
    echo "push attempt $attempt lost a race; rebasing on $branch"
    git "${auth[@]}" pull --rebase --quiet origin "$branch"
done
echo "could not push to $branch" >&2
exit 1
