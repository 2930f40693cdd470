#!/usr/bin/env bash
# An older spmdmoe beside the current one, for side-by-side benchmarks in ONE process
# (`vs_torchtitan.py --base DIR`): the package at git REV, renamed `spmdmoe_base`, its custom-op
# namespace renamed `spmdmoe_base::` (two copies cannot register the same op names).
#   bash benchmarks/base_copy.sh REV DIR        # from a git checkout
#   bash benchmarks/base_copy.sh TARBALL DIR    # from `git archive REV spmdmoe` (a machine without .git)
set -euo pipefail
SRC=$1; DIR=$2
rm -rf "$DIR/spmdmoe_base"; mkdir -p "$DIR/tmp_base"
if [ -f "$SRC" ]; then tar -xf "$SRC" -C "$DIR/tmp_base"; else git archive "$SRC" spmdmoe | tar -x -C "$DIR/tmp_base"; fi
mv "$DIR/tmp_base/spmdmoe" "$DIR/spmdmoe_base"; rm -rf "$DIR/tmp_base"
grep -rl "spmdmoe::" "$DIR/spmdmoe_base" | xargs sed -i 's/spmdmoe::/spmdmoe_base::/g'
echo "spmdmoe at $SRC -> $DIR/spmdmoe_base"
