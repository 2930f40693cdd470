#!/usr/bin/env bash
# Downloads transformers and what importing its models needs (the Makefile's TRANSFORMERS pins) as wheels for the
# GPU host (Python 3.12, no network) into the git-ignored .whl/, beside ../shared/tools/peer_wheels.sh's; carry
# .whl and `gpu_session.sh hf` installs them (--no-deps). Run from the project root: bash benchmarks/hf_wheels.sh
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=$(make -s -f Makefile -f - print-transformers <<<'print-transformers: ; @echo $(TRANSFORMERS)')
for pkg in $pins; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$dest" "$pkg"
done
ls -la "$dest"
