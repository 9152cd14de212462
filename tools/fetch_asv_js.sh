#!/usr/bin/env bash
# Local copies of the scripts and stylesheet that asv's published page loads from public CDNs,
# for machines that cannot reach those CDNs. Each file is written under the last part of its CDN
# address, which is how tests/suite/test_asv_page.py finds it through RMSNORM_ASV_JS:
#
#     bash tools/fetch_asv_js.sh                  # writes .asv/js
#     RMSNORM_ASV_JS=.asv/js nox -s history
#
# Usage: tools/fetch_asv_js.sh [DEST]   (DEST defaults to .asv/js, relative to the current folder)
#
# The files come from the npm packages of the same versions as the CDN copies, fetched with
# `npm pack` (the configured npm registry; nothing is installed).
set -euo pipefail

dest=${1:-.asv/js}

if ! command -v npm >/dev/null 2>&1; then
    echo "fetch_asv_js.sh: npm is not installed (it fetches the packages with npm pack); install Node.js and npm first" >&2
    exit 1
fi

# The packages, as asv's www/index.html names them on the CDNs.
# stupid-table-plugin: the page uses 1.0.1, which was never published to npm; 1.1.3 is the
# nearest release there and keeps the same jQuery plugin interface ($.fn.stupidtable, $.fn.stupidsort).
packages=(
    jquery@3.3.1
    flot@0.8.3
    flot-orderbars@1.0.0
    stupid-table-plugin@1.1.3
    blueimp-md5@2.19.0
    bootstrap@3.1.1
)

work=$(mktemp -d "${TMPDIR:-/tmp}/fetch-asv-js.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "npm pack ${packages[*]}"
(cd "$work" && npm pack --silent "${packages[@]}" >/dev/null)

for tarball in "$work"/*.tgz; do
    name=$(basename "$tarball" .tgz)
    mkdir -p "$work/$name"
    tar -xzf "$tarball" -C "$work/$name"
done

mkdir -p "$dest"

# put SOURCE (inside the unpacked package PACKAGE) to DEST/NAME
put() {
    local package=$1 source=$2 name=$3
    local from="$work/$package/package/$source"
    if [[ ! -f $from ]]; then
        echo "fetch_asv_js.sh: $package has no $source" >&2
        exit 1
    fi
    cp "$from" "$dest/$name"
    printf '%s/%-32s <- %s/%s\n' "$dest" "$name" "$package" "$source"
}

put jquery-3.3.1 dist/jquery.min.js jquery-3.3.1.min.js
# flot 0.8.3 on npm ships no minified files: the unminified ones go under the CDN's .min.js names.
put flot-0.8.3 jquery.flot.js jquery.flot.min.js
put flot-0.8.3 jquery.flot.time.js jquery.flot.time.min.js
put flot-0.8.3 jquery.flot.selection.js jquery.flot.selection.min.js
put flot-0.8.3 jquery.flot.categories.js jquery.flot.categories.min.js
put flot-orderbars-1.0.0 js/jquery.flot.orderBars.js jquery.flot.orderBars.js
put stupid-table-plugin-1.1.3 stupidtable.min.js stupidtable.min.js
put blueimp-md5-2.19.0 js/md5.min.js md5.min.js
put bootstrap-3.1.1 dist/js/bootstrap.min.js bootstrap.min.js
put bootstrap-3.1.1 dist/css/bootstrap.min.css bootstrap.min.css

echo "wrote $(find "$dest" -maxdepth 1 -type f | wc -l) files to $dest"
