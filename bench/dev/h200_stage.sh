#!/usr/bin/env bash
# Stage this checkout for a device call of bench/dev/h200_pending.sh, and undo it afterwards. A device call copies
# the tracked files plus the untracked files that git does not ignore, at most 64 MiB with what `carry` names. The
# tracked tree is larger than that because of the ds4-tiny checkpoint, its ① base and the official golden
# checkpoints.
#
#   bash bench/dev/h200_stage.sh [REV [BASE]]   # before the call. REV is the commit whose kernels/ the "before"
#                                               # parts time (default 9e36682); BASE (default HEAD) the one the
#                                               # "base" part compares the working tree's kernels/ with.
#   bash bench/dev/h200_stage.sh --undo  # after the call: the index and .git/info/exclude as they were
#
# Staging does five things:
# - downloads the wheels the device lacks into .whl/ (ignored; pass carry [".whl"]);
# - writes REV's kernels/ into ab/ (untracked, not ignored, so it travels);
# - writes BASE's copy of every kernels/ file that differs between BASE and the working tree into ab_head/ (the
#   "base" part of h200_pending.sh times the tree with them: the newest kernel change against its base);
# - untracks the three large paths with `git rm --cached`, keeping the files here;
# - lists them in .git/info/exclude, between marker lines.
# It then prints the size of what the device will get. The engine tests fall back to the random tiny stack there.
# Nothing is committed: commit only with explicit paths (`git commit -- paths`) while staged. Do not `git stash` while
# staged: `git stash pop` restores the files but not the index, so the large paths are tracked again (and sent);
# `git rm -r --cached` them again, or --undo and stage anew.
set -eu
cd "$(git rev-parse --show-toplevel)"
BIG=(models/ds4-tiny models/ds4-tiny-base.gguf tests/golden/official_v41_tiny)
EXCLUDE=.git/info/exclude
BEGIN="# h200_stage begin"
END="# h200_stage end"
PY=${PYTHON:-.venv/bin/python}

if [ "${1:-}" = "--undo" ]; then
    git reset -q -- "${BIG[@]}"
    if [ -f "$EXCLUDE" ]; then
        sed -i "/^$BEGIN\$/,/^$END\$/d" "$EXCLUDE"
    fi
    rm -rf ab ab_head
    echo "unstaged: ${BIG[*]} tracked again, ab/ and ab_head/ removed (.whl/ kept; it is ignored)"
    git status --short | head -5
    exit 0
fi

REV=${1:-9e36682}
BASE=${2:-HEAD}
for c in "$REV" "$BASE"; do
    git rev-parse -q --verify "$c^{commit}" > /dev/null || { echo "h200_stage: unknown commit $c" >&2; exit 2; }
done
if grep -qx "$BEGIN" "$EXCLUDE" 2>/dev/null; then
    echo "h200_stage: already staged (run --undo first)" >&2
    exit 2
fi
mkdir -p .whl
"$PY" -m pip download -q --no-deps -d .whl gguf llguidance
rm -rf ab && mkdir -p ab
git archive "$REV" kernels | tar -x -C ab
rm -rf ab_head
for f in $(git diff --name-only "$BASE" -- kernels); do
    git cat-file -e "$BASE:$f" 2>/dev/null || continue          # new in the tree: nothing to swap back
    mkdir -p "ab_head/$(dirname "$f")"
    git show "$BASE:$f" > "ab_head/$f"
done
git rm -r -q --cached "${BIG[@]}"
printf '%s\n' "$BEGIN" "${BIG[@]/#//}" "$END" >> "$EXCLUDE"
bytes=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
whl=$(du -cb .whl | tail -1 | cut -f1)
echo "staged: the tree the device gets is $((bytes / 1048576)) MiB, .whl $((whl / 1048576)) MiB (limit 64 MiB together)"
echo "before-files of $REV in ab/; after the call: bash bench/dev/h200_stage.sh --undo"
