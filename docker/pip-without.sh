#!/bin/sh
# pip-without.sh NAMES REQUIREMENT...: installs what `pip install REQUIREMENT...` would,
# at the versions pip's own resolver picks, except the distributions NAMES (a comma
# list) that no fedq code path uses (triton: torch.compile's GPU compiler). Every
# requirement that pulls one in still installs; the name is left out of the result.
# Options go through pip's environment (PIP_INDEX_URL, PIP_CONSTRAINT, ...), so the
# second call resolves nothing new: it installs the first call's list with --no-deps.
set -eu
skip=$1
shift
report=$(mktemp)
pins=$(mktemp)
pip install --dry-run --quiet --report "$report" "$@"
python3 - "$report" "$skip" >"$pins" <<'PY'
import json
import sys

skip = {name.strip().lower() for name in sys.argv[2].split(",")}
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if meta["name"].lower().replace("_", "-") in skip:
        continue
    if "dir_info" in item["download_info"]:  # a local project: its folder
        print(item["download_info"]["url"].removeprefix("file://"))
    else:
        print(f"{meta['name']}=={meta['version']}")
PY
pip install --no-deps -r "$pins"
rm -f "$report" "$pins"
